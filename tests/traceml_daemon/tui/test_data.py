"""The TUI's data module: bounded reads, downsampling, absent values."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from traceml_daemon.tui.data import DatabaseMissing, TuiData, _Buckets, downsample, median
from traceml_daemon.tui.synth import SynthSpec, build, step_row
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
    b = _Buckets("steps", ("step_ns",), "rank_id=?", (1,), 64)
    b.update(ro)
    s = b.series(0)
    assert 0 < len(s.steps) <= 64 and s.steps[-1] == 999
    # Append steps while the reader is open (WAL): the next update extends, still bounded.
    rw = sqlite3.connect(db)
    rw.executemany(
        "INSERT INTO steps VALUES (" + ",".join("?" * 15) + ")", [step_row(1, 0, i, None) for i in range(1000, 3000)]
    )
    rw.commit()
    b.update(ro)
    s = b.series(0)
    assert len(s.steps) <= 64 and s.steps[-1] == 2999


def test_overview_rows_and_absent_metrics(tui_db: str) -> None:
    data = TuiData(tui_db, clock=lambda: 0.0)
    ov = data.overview()
    h = ov.header
    assert (h.session, h.nnodes, h.world_size, h.parallelism, h.latest_step) == ("run-synth", 2, 4, "fsdp2", 199)
    assert h.live is False and h.delivery.spooled == 3 and h.delivery.dropped == 0
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
    rw.executemany(
        "INSERT INTO steps VALUES (" + ",".join("?" * 15) + ")", [step_row(g + 1, g, 200, None) for g in range(4)]
    )
    rw.commit()
    ov = data.overview()
    assert ov.header.latest_step == 200 and all(r.last_step == 200 for r in ov.ranks)
    assert ov.step_series.steps[-1] == 200


def test_missing_db_names_path(tmp_path: Path) -> None:
    with pytest.raises(DatabaseMissing, match="nope.db"):
        TuiData(str(tmp_path / "nope.db"))
