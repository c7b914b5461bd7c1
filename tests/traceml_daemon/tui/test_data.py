"""The TUI's data module: bounded reads, downsampling, absent values."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

import pytest

from tests.support.synth_db import SynthSpec, build, insert_rows, step_row
from traceml_daemon.analysis.rolling import RankWindow
from traceml_daemon.ingest.live import Aggregates
from traceml_daemon.store.migrate import migrate
from traceml_daemon.store.read.series import step_buckets
from traceml_daemon.store.read.steps import STEP_COLS
from traceml_daemon.store.reader import load_window_run
from traceml_daemon.store.schema import SCHEMA_VERSION
from traceml_daemon.tui.analyzer import Analyzer
from traceml_daemon.tui.data import WINDOW, TuiData
from traceml_daemon.tui.model import Analysis, DatabaseMissing, RankRow, downsample, median, nodes_from, with_analysis
from traceml_daemon.tui.ranks import LiveRank
from traceml_daemon.tui.widgets import resample


def test_downsample_bounds_and_keeps_latest() -> None:
    for n in (0, 1, 5, 99, 100, 101, 1000, 12345):
        steps = list(range(n))
        values: list[float | None] = [float(i) for i in steps]
        for w in (1, 7, 100):
            s = downsample(steps, values, w)
            assert len(s.steps) <= w
            if n:
                assert s.steps[-1] == n - 1


def test_downsample_none_stays_none() -> None:
    s = downsample(list(range(10)), [None] * 10, 5)
    assert s.values == [None] * 5
    assert median([None, None]) is None
    assert resample([None, 1.0, None], 3) == [None, 1.0, None]


def test_sql_buckets_bounded_incremental(tmp_path: Path) -> None:
    db = build(str(tmp_path / "b.db"), SynthSpec(nnodes=1, ranks_per_node=1, steps=1000, with_detail=False))
    ro = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    b = step_buckets(1, ("step_ns",), 64)
    b.update(ro)
    s = b.series(0)
    assert 0 < len(s.steps) <= 64 and s.steps[-1] == 999
    # Append steps while the reader is open (WAL): the next update extends, still bounded.
    rw = sqlite3.connect(db)
    insert_rows(rw, "steps", [step_row(1, 0, i, None) for i in range(1000, 3000)])
    rw.commit()
    b.update(ro)
    s = b.series(0)
    assert len(s.steps) <= 64 and s.steps[-1] == 2999


def test_overview_rows_and_absent_metrics(tui_db: str) -> None:
    data = TuiData(tui_db, clock=lambda: 0.0)
    ov = data.overview()
    h = ov.header
    assert (h.session, h.nnodes, h.world_size, h.parallelism, h.latest_step) == ("run-synth", 2, 4, "fsdp2", 199)
    assert h.live is False and h.delivery.spooled == 3
    assert (h.delivery.rows_dropped, h.delivery.batches_dropped, h.delivery.lost) == (0, 0, False)
    assert (h.delivery.frames_received, h.delivery.duplicates_discarded) == (400, 2)
    assert [r.global_rank for r in ov.ranks] == [0, 1, 2, 3]
    r3 = ov.ranks[3]
    assert r3.node_rank == 1 and r3.phase_ms["forward"] == pytest.approx(14.0)
    assert ov.ranks[0].phase_ms["forward"] == pytest.approx(10.0)
    assert len(ov.nodes) == 2 and all(n.ranks == 2 for n in ov.nodes)
    assert len(ov.step_series.steps) <= data.series_points and ov.step_series.steps[-1] == 199
    node1 = data.node_detail(1)
    assert node1 is not None and node1.system is not None
    assert node1.system.net_rx_bps is None  # absent stays absent
    assert [g.power_w for g in node1.gpus] == [250.0, None]
    rank = data.rank_detail(0)
    assert rank is not None
    assert set(rank.scalars) == {"loss", "lr"}
    assert [lr.layer for lr in rank.layers] == ["embed", "blocks.0", "blocks.1", "head"] and rank.layers_step == 100
    assert rank.models[0].local_shard_bytes == 7 * 2**30 // 4
    assert rank.process is not None and rank.process.gpu_mem_bytes is None
    assert data.rank_detail(99) is None and data.node_detail(9) is None


def test_incremental_tail_sees_new_steps(tui_db: str) -> None:
    data = TuiData(tui_db, clock=lambda: 0.0)
    assert data.overview().header.latest_step == 199
    rw = sqlite3.connect(tui_db)
    insert_rows(rw, "steps", [step_row(g + 1, g, 200, None) for g in range(4)])
    rw.commit()
    ov = data.overview()
    assert ov.header.latest_step == 200 and all(r.last_step == 200 for r in ov.ranks)
    assert ov.step_series.steps[-1] == 200


def test_missing_db_names_path(tmp_path: Path) -> None:
    with pytest.raises(DatabaseMissing, match="nope.db"):
        TuiData(str(tmp_path / "nope.db"))


# ---- parallelism, worst rank, history, set-based reads


def _ddp_db(tmp_path: Path, straggler: int, hello: str = "single") -> str:
    """A DDP run whose agents said ``hello`` at hello time (before the model was seen)."""
    db = build(str(tmp_path / "ddp.db"), SynthSpec(parallelism="ddp", straggler=straggler))
    rw = sqlite3.connect(db)
    rw.execute("UPDATE ranks SET parallelism=?", (hello,))
    rw.commit()
    rw.close()
    return db


def test_header_parallelism_comes_from_the_models_table(tmp_path: Path) -> None:
    db = _ddp_db(tmp_path, straggler=3)
    assert TuiData(db).overview().header.parallelism == "ddp"
    rw = sqlite3.connect(db)
    rw.execute("DELETE FROM models")
    rw.commit()
    rw.close()
    assert TuiData(db).overview().header.parallelism == "single"  # nothing but the hello left


@pytest.mark.parametrize(("straggler", "node", "other"), [(3, 1, 0), (1, 0, 1)])
def test_node_worst_rank_is_the_busiest_as_in_node_views(tmp_path: Path, straggler: int, node: int, other: int) -> None:
    from traceml_daemon.analysis.nodes import node_views

    db = _ddp_db(tmp_path, straggler)
    data = TuiData(db)
    plain = data.overview()
    # Under DDP every rank reports the same step time: step time cannot name the straggler.
    assert len({r.step_ms for r in plain.ranks}) == 1
    assert all(n.worst_rank is None for n in plain.nodes)  # unknown until analysed, never guessed
    analyzer = Analyzer(db)
    analysis = analyzer.run()
    ov = data.overview(analysis)
    nodes = {n.node_rank: n for n in ov.nodes}
    assert nodes[node].worst_rank == straggler
    ro = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    expected = {v["node_rank"]: v for v in node_views(load_window_run(ro, WINDOW))}
    assert nodes[node].worst_busy_ms == expected[node]["worst_rank"]["busy_ms_median"]
    assert nodes[node].worst_busy_ms is not None and nodes[other].worst_busy_ms is not None
    assert nodes[node].worst_busy_ms > nodes[other].worst_busy_ms  # fwd +4 ms, wait -4 ms
    assert nodes[node].skew_pct is not None and nodes[node].skew_pct > 0
    assert ov.nodes[0].node_rank == node  # equal step medians: the busier node sorts first
    assert ov.header.parallelism == "ddp"
    # with_analysis merges without reading: the same rows as a fresh overview.
    assert with_analysis(plain, analysis).nodes == ov.nodes


def _migrate_and_retain(db: str, keep_last: int) -> None:
    """Open a v1 database the way the daemon does (``migrate`` backfills the history from
    raw steps), then drop old raw steps the way retention does, so only the history
    knows the start of the run."""
    assert migrate(db) == SCHEMA_VERSION
    rw = sqlite3.connect(db)
    (hi,) = rw.execute("SELECT MAX(step) FROM steps").fetchone()
    rw.execute("DELETE FROM steps WHERE step <= ?", (hi - keep_last,))
    rw.commit()
    rw.close()


def test_overview_series_and_span_cover_the_whole_run_from_history(tmp_path: Path) -> None:
    db = build(str(tmp_path / "h.db"), SynthSpec(steps=5000, with_detail=False), version=1)
    v1 = TuiData(db).overview()
    assert v1.header.history is False and v1.series_label == "step r0"
    _migrate_and_retain(db, keep_last=64)
    data = TuiData(db, series_points=50)
    ov = data.overview()
    assert ov.header.history is True
    assert (ov.header.first_step, ov.header.latest_step) == (0, 4999)
    assert ov.series_label == "all ranks"
    s = ov.step_series
    assert 10 <= len(s.values) <= 50
    assert s.steps[0] < 1000 and s.steps[-1] == 4999  # starts where raw rows no longer exist
    assert all(v == pytest.approx(43.2, abs=0.3) for v in s.values)  # every rank's step is 43.0-43.4 ms
    # Medians still come from the newest raw steps; ranks keep their identity.
    assert [r.global_rank for r in ov.ranks] == [0, 1, 2, 3]
    assert ov.ranks[3].phase_ms["forward"] == pytest.approx(14.0)


def test_first_load_is_set_based(tmp_path: Path) -> None:
    """The number of statements for the first overview does not grow with the ranks."""

    def statements(world: int) -> int:
        db = build(
            str(tmp_path / f"s{world}.db"), SynthSpec(nnodes=world // 4, ranks_per_node=4, steps=40, with_detail=False)
        )
        data = TuiData(db)
        seen: list[str] = []
        data.con.set_trace_callback(seen.append)
        ov = data.overview()
        assert len(ov.ranks) == world and all(r.step_ms is not None for r in ov.ranks)
        return len(seen)

    assert statements(4) == statements(64)


def _live_rank(window: int = WINDOW) -> LiveRank:
    return LiveRank(1, 0, 0, 0, None, None, RankWindow(1, 0, 0, window=window))


def _medians(rows: list[tuple[object, ...]]) -> tuple[float | None, dict[str, float | None]]:
    st = _live_rank()
    st.add(rows)
    row = st.row()
    return row.step_ms, row.phase_ms


def _stored(rank_id: int, step: int) -> tuple[object, ...]:
    """A step row as the read layer returns it (``STEP_COLS``)."""
    return step_row(rank_id, 0, step, None)[1 : 1 + len(STEP_COLS)]


def test_medians_ignore_absent_values() -> None:
    rows = [_stored(1, s) for s in range(3)]
    rows = [r[:3] + (None,) + r[4:] for r in rows]  # dataloader never measured
    rows[0] = rows[0][:2] + (None,) + rows[0][3:]  # one step time missing
    step_ms, phases = _medians(rows)
    assert phases["dataloader"] is None
    assert step_ms is not None and phases["forward"] == pytest.approx(10.0)
    one = [rows[0][:3] + (None,) + rows[0][4:]]
    assert _medians(one)[1]["dataloader"] is None


def test_sliding_window_medians_match_a_fresh_median_and_the_daemons() -> None:
    # The TUI keeps the daemon's own window (analysis.rolling.RankWindow): a median over
    # each series' newest 32 measured values, a step written again counting as a row,
    # as in /metrics. It must agree with a median computed from scratch over those
    # values, holes included, and with the daemon's Aggregates fed the same rows.
    rng = random.Random(7)
    st = _live_rank(32)
    daemon = Aggregates(window=32)
    pushed: list[tuple[object, ...]] = []
    step = 0
    while step < 300:
        batch = []
        for _ in range(rng.choice((1, 1, 1, 3, 40))):  # the tail brings one row or many
            row = _stored(1, step)
            values = [None if rng.random() < 0.1 else rng.randrange(1, 50) * 1_000_000 for _ in range(7)]
            batch.append(row[:2] + tuple(values) + row[9:])
            if rng.random() < 0.2:  # a step written again
                batch.append(row[:2] + tuple(v if v is None else v + 1 for v in values) + row[9:])
            step += 1
        st.add(batch)
        daemon.add_steps(1, {name: [r[i] for r in batch] for i, name in enumerate(STEP_COLS)})
        pushed += batch
        got = [st.row().step_ms, *st.row().phase_ms.values()]
        expect = [median([v for r in pushed if (v := r[i]) is not None][-32:]) for i in range(2, 9)]
        assert got == [None if e is None else pytest.approx(e / 1e6) for e in expect]
        (snap,) = daemon.snapshot()
        assert got == [snap.step_ms_median, *snap.phases_ms_median.values()]
    assert (st.first_step, st.last_step) == (0, step - 1)


def test_changed_is_true_only_after_a_commit(tui_db: str) -> None:
    data = TuiData(tui_db, clock=lambda: 0.0)
    assert data.changed()  # nothing seen yet
    assert not data.changed()
    data.overview()  # its own reads are no change
    assert not data.changed()
    rw = sqlite3.connect(tui_db)
    insert_rows(rw, "steps", [step_row(g + 1, g, 200, None) for g in range(4)])
    rw.commit()
    assert data.changed()
    assert not data.changed()
    rw.close()
    data.close()


# ---- the synthetic database, delivery counters, host findings


def test_synth_builds_the_current_schema_with_history(tmp_path: Path) -> None:
    from traceml_daemon.store.reader import schema_version

    db = build(str(tmp_path / "v.db"), SynthSpec(with_detail=False))
    ro = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    assert schema_version(ro) == SCHEMA_VERSION
    # v2's backfill ran over the raw steps; v3's one-status-row-per-rank index exists.
    assert ro.execute("SELECT sum(n) FROM node_history WHERE level=64").fetchone()[0] == 4 * 200
    assert ro.execute("SELECT 1 FROM sqlite_master WHERE name='status_one_per_rank'").fetchone() is not None
    old = build(str(tmp_path / "v1.db"), SynthSpec(with_detail=False), version=1)
    assert schema_version(sqlite3.connect(f"file:{old}?mode=ro", uri=True)) == 1


def test_sparkline_draws_raw_steps_until_the_history_has_enough_points(tmp_path: Path) -> None:
    # 200 steps are 4 history points (64 steps each): the raw steps of rank 0 say more.
    young = TuiData(build(str(tmp_path / "young.db"), SynthSpec(with_detail=False))).overview()
    assert young.header.history is True and young.header.first_step == 0
    assert young.series_label == "step r0" and len(young.step_series.values) >= 50
    # 2500 steps are 40 history points: the whole run across ranks, bounded by the width.
    long_run = SynthSpec(nnodes=1, ranks_per_node=2, steps=2500, straggler=None, with_detail=False)
    old = TuiData(build(str(tmp_path / "old.db"), long_run), series_points=50).overview()
    assert old.series_label == "all ranks" and 32 <= len(old.step_series.values) <= 50
    assert old.step_series.steps[-1] == 2499


def test_delivery_counts_rows_and_batches_apart_and_never_bytes(tmp_path: Path) -> None:
    spec = SynthSpec(
        with_detail=False,
        rows_dropped=7,
        relay_dropped_batches=2,
        relay_dropped_bytes=5_000_000,
        spool_dropped_batches=1,
    )
    d = TuiData(build(str(tmp_path / "d.db"), spec)).overview().header.delivery
    # dropped_batches (3) already holds the spool's drop (1); dropped_bytes is a size, not a count.
    assert (d.rows_dropped, d.batches_dropped, d.lost) == (7, 3, True)
    assert d.spooled == 3 + 1  # node 1's resent batches and the one node 0 spooled before dropping it
    assert d.counters["relay_dropped_bytes"] == 5_000_000  # still listed, as information


def test_synth_relay_counters_are_the_relays_own() -> None:
    from relay.upstream import RelayStats
    from tests.support.synth_db import DAEMON_COUNTERS, RELAY_COUNTERS
    from traceml_daemon.ingest.counters import Counters

    assert set(RELAY_COUNTERS) == set(RelayStats().as_dict())
    assert set(DAEMON_COUNTERS) == set(Counters().as_dict())


def test_analyzer_judges_the_newest_host_samples(tmp_path: Path) -> None:
    db = build(str(tmp_path / "hot.db"), SynthSpec(saturated_node=1))
    ro = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    systems = {s.node_rank: s for s in load_window_run(ro, WINDOW).systems}
    assert set(systems) == {0, 1} and systems[1].mem_total_bytes == 256 * 2**30
    assert len(systems[1].cpu_pct) == WINDOW < 60  # the newest window of the 60 samples written
    assert len(systems[1].gpu_util_pct) == 2
    found = {(v.name, v.scope.get("node_rank")) for v in Analyzer(db).run().verdicts}
    assert {("HOST_MEM_SATURATED", 1), ("HOST_CPU_SATURATED", 1)} <= found
    assert not any(name.startswith("HOST_") and node == 0 for name, node in found)


def test_data_module_does_not_import_textual() -> None:
    import subprocess
    import sys

    code = "import sys, traceml_daemon.tui.data; print(sorted(m for m in sys.modules if m.split('.')[0] == 'textual'))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


def test_busier_node_sorts_first_even_when_its_step_median_is_a_hair_lower() -> None:
    # DDP: both nodes' step medians are the all-reduce's, equal up to noise (the demo
    # showed 36.1 vs 35.7 ms with the slow rank on the lower one).
    def rank(global_rank: int, node: int, step_ms: float) -> RankRow:
        return RankRow(global_rank, global_rank, global_rank % 2, node, "vm", 100, 99, step_ms, {}, None, None)

    rows = [rank(0, 0, 36.1), rank(1, 0, 36.2), rank(2, 1, 35.6), rank(3, 1, 35.8)]
    views = {
        0: {"worst_rank": {"global_rank": 0, "busy_ms_median": 2.2}, "busy_ms_median": 2.1},
        1: {"worst_rank": {"global_rank": 3, "busy_ms_median": 27.5}, "busy_ms_median": 14.8},
    }
    ordered = nodes_from(rows, Analysis(available=True, nodes=views))
    assert [n.node_rank for n in ordered] == [1, 0]
    assert ordered[0].worst_rank == 3
    # Before any analysis there is no busy time: the step median decides.
    assert [n.node_rank for n in nodes_from(rows)] == [0, 1]
