"""Live aggregates under FSDP2: busy time is the step less the collective wait the agent
measured inside forward and backward, so the worst rank is the one slow in its own work."""

from __future__ import annotations

from traceml_daemon.ingest.live import STEP_COLUMNS, Aggregates

MS = 1_000_000


def _cols(n: int, fwd_comm_ms: float | None, bwd_comm_ms: float | None) -> dict[str, list[object]]:
    return {
        "step": list(range(n)),
        "ts": [100.0 + s for s in range(n)],
        "step_ns": [60 * MS] * n,  # every rank's step is as long as the slowest's
        "forward_ns": [10 * MS] * n,
        "backward_ns": [45 * MS] * n,
        "wait_ns": [1 * MS] * n,  # the residual under FSDP2: the rank's own work
        "fwd_comm_ns": [None if fwd_comm_ms is None else int(fwd_comm_ms * MS)] * n,
        "bwd_comm_ns": [None if bwd_comm_ms is None else int(bwd_comm_ms * MS)] * n,
    }


def test_the_rank_waiting_least_in_fsdp2_collectives_is_the_worst() -> None:
    agg = Aggregates(window=10)
    # rank 1 computes 30 ms longer in backward; ranks 0 and 2 wait for it in the reduce-scatter
    for rank_id, (gr, bwd_comm) in enumerate([(0, 35.0), (1, 5.0), (2, 35.0)], start=1):
        agg.add_steps(rank_id, _cols(5, 3.0, bwd_comm), global_rank=gr, node_rank=0)
    live = agg.live()
    assert live.worst_rank == 1 and live.nodes[0].worst_rank == 1
    assert [r.busy_ms_median for r in live.ranks] == [22.0, 52.0, 22.0]


def test_without_measured_collectives_busy_stays_the_step() -> None:
    agg = Aggregates(window=10)
    agg.add_steps(1, _cols(5, None, None), global_rank=0, node_rank=0)
    assert agg.live().ranks[0].busy_ms_median == 60.0


def test_decoded_batches_carry_the_fsdp2_columns() -> None:
    by_map, by_batch = Aggregates(window=8), Aggregates(window=8)
    cols = _cols(6, 2.0, 8.0)
    by_map.add_steps(1, cols, global_rank=0, node_rank=0)
    batch = [tuple(cols.get(name) or (None,) * 6) for name in STEP_COLUMNS]
    by_batch.add_batches(1, [batch], global_rank=0, node_rank=0)
    assert by_map.live().ranks[0].busy_ms_median == by_batch.live().ranks[0].busy_ms_median == 50.0
