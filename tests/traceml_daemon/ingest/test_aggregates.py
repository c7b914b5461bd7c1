"""Live aggregates: rolling per-rank medians, per-node views and skews."""

from __future__ import annotations

from traceml_daemon.ingest.live import Aggregates


def _cols(first: int, n: int, step_ns: int, fwd: int | None = 1_000_000) -> dict[str, list[object]]:
    return {
        "step": list(range(first, first + n)),
        "ts": [100.0 + s for s in range(first, first + n)],
        "step_ns": [step_ns] * n,
        "forward_ns": [fwd] * n,
    }


def test_live_snapshot_nodes_worst_rank_and_skews() -> None:
    agg = Aggregates(window=10)
    # node 0: ranks 0,1 at 20 ms; node 1: rank 2 at 20 ms, rank 3 a straggler at 30 ms.
    for rank_id, (gr, node, ms) in enumerate([(0, 0, 20), (1, 0, 20), (2, 1, 20), (3, 1, 30)], start=1):
        agg.add_steps(rank_id, _cols(0, 5, ms * 1_000_000), global_rank=gr, node_rank=node)
    live = agg.live()
    assert [r.global_rank for r in live.ranks] == [0, 1, 2, 3]
    assert live.worst_rank == 3 and live.worst_step_ms == 30.0
    assert live.step_ms_median == 20.0 and live.rank_skew == 0.5
    n0, n1 = live.nodes
    assert (n0.ranks, n0.step_ms_median, n0.skew) == ([0, 1], 20.0, 0.0)
    assert (n1.ranks, n1.step_ms_median, n1.worst_rank) == ([2, 3], 25.0, 3)
    assert live.worst_node == 1 and live.node_skew == (25.0 - 22.5) / 22.5
    assert n0.phases_ms_median["forward"] == 1.0 and n1.last_step == 4


def test_window_rolls_and_unmeasured_values_stay_out() -> None:
    agg = Aggregates(window=4)
    agg.add_steps(1, _cols(0, 4, 10_000_000), global_rank=0, node_rank=0)
    assert agg.snapshot()[0].step_ms_median == 10.0
    agg.add_steps(1, _cols(4, 3, 50_000_000, fwd=None), global_rank=0, node_rank=0)
    snap = agg.snapshot()[0]
    assert snap.step_ms_median == 50.0  # window of 4: one 10 ms, three 50 ms
    assert snap.phases_ms_median["forward"] == 1.0  # None never entered the window
    assert snap.steps_seen == 7 and snap.last_step == 6 and snap.last_ts == 106.0


def test_worst_rank_under_ddp_is_the_busiest_not_the_slowest_step() -> None:
    # DDP: every rank's step is 30 ms; rank 1 waits least on its peers, so it is the straggler.
    agg = Aggregates(window=10)
    for rank_id, (gr, wait_ms) in enumerate([(0, 10), (1, 2), (2, 8)], start=1):
        cols = _cols(0, 5, 30_000_000)
        cols["wait_ns"] = [wait_ms * 1_000_000] * 5
        cols["comm_ns"] = [wait_ms * 1_000_000] * 5
        agg.add_steps(rank_id, cols, global_rank=gr, node_rank=0)
    live = agg.live()
    assert live.worst_rank == 1 and live.nodes[0].worst_rank == 1
    assert live.ranks[1].busy_ms_median == 28.0 and live.worst_step_ms == 30.0


def test_decoded_batches_fold_like_column_maps() -> None:
    from traceml_daemon.ingest.live import STEP_COLUMNS

    by_map, by_batch = Aggregates(window=8), Aggregates(window=8)
    for i in range(6):
        cols = _cols(3 * i, 3, (10 + i) * 1_000_000, fwd=None if i == 2 else 1_000_000)
        cols["wait_ns"] = [None, 2_000_000, 1_000_000]
        by_map.add_steps(1, cols, global_rank=0, node_rank=0)
        batch = tuple(tuple(cols[c]) if c in cols else (None,) * 3 for c in STEP_COLUMNS)
        by_batch.add_batches(1, [batch], global_rank=0, node_rank=0)
    assert by_map.snapshot() == by_batch.snapshot()


def test_many_windows_pushed_at_once_fold_like_one_batch_at_a_time() -> None:
    """A fast rank sends many windows' worth between folds: chunks older than the
    window only advance the counters, and every figure matches pushing one at a time."""
    from traceml_daemon.ingest.live import STEP_COLUMNS

    def batch(i: int) -> tuple[tuple[object, ...], ...]:
        cols = _cols(5 * i, 5, (10 + i % 7) * 1_000_000)
        cols["wait_ns"] = [1_000_000 * (i % 3)] * 5
        cols["comm_ns"] = [500_000] * 5 if i == 1 else [None] * 5  # only an old chunk measures comm
        return tuple(tuple(cols[c]) if c in cols else (None,) * 5 for c in STEP_COLUMNS)

    batches = [batch(i) for i in range(40)]  # 200 rows, window 16
    at_once, one_by_one = Aggregates(window=16), Aggregates(window=16)
    at_once.add_batches(1, batches, global_rank=0, node_rank=0)
    for b in batches:
        one_by_one.add_batches(1, [b], global_rank=0, node_rank=0)
        one_by_one.snapshot()  # a read after every batch folds it alone
    got, want = at_once.snapshot()[0], one_by_one.snapshot()[0]
    assert got == want
    assert (got.steps_seen, got.last_step, got.last_ts) == (200, 199, 299.0)
    assert got.busy_ms_median != got.step_ms_median  # wait measured: seen in a skipped chunk
