"""Pilot-driven navigation of every screen at 80x24 against a db built from rows."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from textual.widgets import DataTable, Input

from tests.support.synth_db import SynthSpec, build, step_row
from tests.traceml_daemon.tui.conftest import asynctest, make_app, press, settle, static_text
from traceml_daemon.tui.app import main, parse_jump
from traceml_daemon.tui.screens import (
    HelpScreen,
    JumpScreen,
    NodeScreen,
    OverviewScreen,
    PagedTable,
    RankScreen,
    VerdictsScreen,
)
from traceml_daemon.tui.widgets import RankGrid
from traceml_wire.tables import columns


@asynctest
async def test_overview_drill_down_and_back(tui_db: str) -> None:
    app = make_app(tui_db)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        assert isinstance(app.screen, OverviewScreen)
        header = static_text(app.screen, "#header")
        assert "run-synth" in header and "4 ranks on 2 nodes" in header and "step 199" in header
        nodes = app.screen.query_one("#nodes", DataTable)
        ranks = app.screen.query_one("#ranks", DataTable)
        assert nodes.row_count == 2 and ranks.row_count == 4
        # Enter on the first node row (focused at mount) opens that node.
        first_node = int(nodes.coordinate_to_cell_key(nodes.cursor_coordinate).row_key.value or 0)
        await press(pilot, "enter")
        assert isinstance(app.screen, NodeScreen) and app.screen.node_rank == first_node
        assert "no host samples" not in static_text(app.screen, "#system")
        gpus = app.screen.query_one("#gpus", DataTable)
        assert gpus.row_count == 2
        assert "—" in [str(c) for c in gpus.get_row_at(1)]  # GPU 1 has no power reading
        # Enter on a rank of the node opens the rank screen.
        await press(pilot, "down", "enter")
        assert isinstance(app.screen, RankScreen)
        assert app.screen.global_rank == first_node * 2 + 1
        await press(pilot, "escape")
        assert isinstance(app.screen, NodeScreen)
        await press(pilot, "escape")
        assert isinstance(app.screen, OverviewScreen)


@asynctest
async def test_rank_screen_shows_layers_scalars_and_fsdp2(tui_db: str) -> None:
    app = make_app(tui_db)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        await pilot.press("tab")  # nodes -> ranks table
        assert app.focused is not None and app.focused.id == "ranks"
        await press(pilot, "enter")
        assert isinstance(app.screen, RankScreen) and app.screen.global_rank == 0
        assert "FSDP2 shard 1.8 GiB" in static_text(app.screen, "#models")
        assert app.screen.query_one("#layers", DataTable).row_count == 4
        assert "GPU mem —" in static_text(app.screen, "#process")
        spark = app.screen.query_one("#scalars")
        assert [line[0] for line in spark.lines] == ["loss", "lr"]  # type: ignore[attr-defined]


@asynctest
async def test_verdicts_help_jump_and_phase_cycle(tui_db: str) -> None:
    app = make_app(tui_db)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        grid = app.screen.query_one(RankGrid)
        assert "step" in grid.caption
        await pilot.press("p")
        assert "dataloader" in grid.caption
        await press(pilot, "v")
        assert isinstance(app.screen, VerdictsScreen)
        assert "spooled 3" in static_text(app.screen, "#delivery")
        await pilot.press("escape")
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        await pilot.press("slash")
        assert isinstance(app.screen, JumpScreen)
        app.screen.query_one(Input).value = "r3"
        await press(pilot, "enter")
        assert isinstance(app.screen, RankScreen) and app.screen.global_rank == 3
        await pilot.press("slash")
        app.screen.query_one(Input).value = "n1"
        await press(pilot, "enter")
        assert isinstance(app.screen, NodeScreen) and app.screen.node_rank == 1
        await pilot.press("slash")
        app.screen.query_one(Input).value = "r77"
        await press(pilot, "enter")
        assert isinstance(app.screen, NodeScreen)  # unknown rank: stays, notifies
        await pilot.press("q")


def test_parse_jump(tui_db: str) -> None:
    from traceml_daemon.tui.data import TuiData
    from traceml_daemon.tui.screens import Snapshot

    snap = Snapshot(TuiData(tui_db).overview())
    assert parse_jump("12", snap) is None
    assert parse_jump("2", snap) == ("rank", 2)
    assert parse_jump(" R3 ", snap) == ("rank", 3)
    assert parse_jump("n1", snap) == ("node", 1)
    assert parse_jump("x", snap) is None


@pytest.mark.parametrize("ranks", [1, 500, 4096])
@asynctest
async def test_rank_grid_aggregates_when_crowded(tmp_path: Path, ranks: int) -> None:
    db = build(str(tmp_path / "g.db"), SynthSpec(nnodes=1, ranks_per_node=ranks, steps=3, with_detail=False))
    app = make_app(db)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        grid = app.screen.query_one(RankGrid)
        cell, group, rows = grid.layout_for(grid.size.width)
        assert rows <= grid.max_rows
        rendered = str(grid.render())
        assert f"{ranks} ranks" in rendered
        assert (group > 1) == ("each cell =" in rendered) == (ranks == 4096)


@asynctest
async def test_no_analysis_engine_still_works(tui_db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "traceml_daemon.analysis.engine", None)  # import fails
    app = make_app(tui_db)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        assert "not available" in static_text(app.screen, "#banner")


def test_main_missing_db_names_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "absent.db")
    assert main(["--db", missing]) == 2
    assert missing in capsys.readouterr().err


def test_tui_package_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, traceml_daemon.tui.app, traceml_daemon.tui.data; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@asynctest
async def test_node_table_names_the_busiest_rank_and_header_the_models_parallelism(tmp_path: Path) -> None:
    # The demo's case: DDP (agents said "single" at hello), slow rank r3 on n1 by busy time.
    db = build(str(tmp_path / "ddp.db"), SynthSpec(parallelism="ddp", straggler=3))
    rw = sqlite3.connect(db)
    rw.execute("UPDATE ranks SET parallelism='single'")
    rw.commit()
    rw.close()
    app = make_app(db)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        assert app.analysis_count >= 1
        assert "  ddp  " in static_text(app.screen, "#header")
        nodes = app.screen.query_one("#nodes", DataTable)
        rows = {str(nodes.get_row_at(i)[0]): [str(c) for c in nodes.get_row_at(i)] for i in range(nodes.row_count)}
        assert rows["n1"][4] == "r3" and rows["n1"][5] == "42.2"  # busy = step - wait: 43.2 - 1.0
        assert rows["n0"][4] in ("r0", "r1") and rows["n0"][5] == "38.2"
        assert str(nodes.get_row_at(0)[0]) == "n1"  # the busier node first


@asynctest
async def test_ranks_table_pages_long_runs(tmp_path: Path) -> None:
    db = build(str(tmp_path / "p.db"), SynthSpec(nnodes=30, ranks_per_node=10, steps=3, with_detail=False))
    app = make_app(db)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        ranks = app.screen.query_one("#ranks", PagedTable)
        assert len(ranks.all_rows) == 300 and ranks.row_count == ranks.page_rows < 300
        assert "of 300" in static_text(app.screen, "#ranks_title")
        ranks.focus()
        await pilot.press("ctrl+end")
        assert ranks.coordinate_to_cell_key(ranks.cursor_coordinate).row_key.value == "299"
        await pilot.press("up")
        assert ranks.coordinate_to_cell_key(ranks.cursor_coordinate).row_key.value == "298"
        await pilot.press("ctrl+home")
        assert ranks.coordinate_to_cell_key(ranks.cursor_coordinate).row_key.value == "0"
        for _ in range(ranks.page_rows):  # walk down past the first page's edge
            await pilot.press("down")
        key = ranks.coordinate_to_cell_key(ranks.cursor_coordinate).row_key.value
        assert key == str(ranks.page_rows)
        await press(pilot, "enter")
        assert isinstance(app.screen, RankScreen) and app.screen.global_rank == ranks.page_rows


@asynctest
async def test_poll_reads_only_after_a_commit(tui_db: str) -> None:
    # Timers far in the future: the test calls the poll itself, so nothing depends on timing.
    from tests.traceml_daemon.tui.conftest import FROZEN_NOW
    from traceml_daemon.tui.app import TraceApp

    app = TraceApp(tui_db, clock=lambda: FROZEN_NOW, refresh_s=3600, poll_s=3600)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        app._last_cost_s = 0.0  # no spacing left to wait out
        app._poll()  # the reader's first look counts as a change
        await settle(pilot)
        count = app.refresh_count
        app._last_cost_s = 0.0  # no spacing left to wait out
        app._poll()
        await settle(pilot)
        assert app.refresh_count == count  # nothing committed: no read
        rw = sqlite3.connect(tui_db)
        rows = [step_row(g + 1, g, 200, None) for g in range(4)]
        names = ("rank_id", *columns("steps"))[: len(rows[0])]  # the columns a step_row states
        rw.executemany(f"INSERT INTO steps ({', '.join(names)}) VALUES ({','.join('?' * len(names))})", rows)
        rw.commit()
        rw.close()
        app._last_cost_s = 0.0
        app._poll()
        await settle(pilot, count + 1)
        assert app.refresh_count == count + 1
        assert "step 200" in static_text(app.screen, "#header")


@asynctest
async def test_losses_show_rows_and_batches_apart_and_bytes_never_count(tmp_path: Path) -> None:
    spec = SynthSpec(rows_dropped=7, relay_dropped_batches=2, relay_dropped_bytes=5_000_000, spool_dropped_batches=1)
    app = make_app(build(str(tmp_path / "lossy.db"), spec))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        assert "LOST 7 rows 3 batches" in static_text(app.screen, "#header")
        await press(pilot, "v")
        lines = static_text(app.screen, "#delivery").splitlines()
        assert lines[0] == "rows dropped 7  batches dropped 3  spooled 4"
        relays = next(line for line in lines if line.startswith("relays:"))
        assert "dropped_bytes 5000000" in relays and "spool_dropped_batches 1" in relays
        agents = next(line for line in lines if line.startswith("agents:"))
        assert "recorder_rows 7" in agents


@asynctest
async def test_node_screen_says_how_many_ranks_have_a_sparkline(tmp_path: Path) -> None:
    db = build(str(tmp_path / "wide.db"), SynthSpec(nnodes=1, ranks_per_node=70, steps=3, with_detail=False))
    app = make_app(db)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        await press(pilot, "enter")
        assert isinstance(app.screen, NodeScreen)
        assert len(app.screen.query_one("#sparks").lines) == 64  # type: ignore[attr-defined]
        assert "showing 64 of 70 ranks" in static_text(app.screen, "#sparks_title")
        assert app.screen.query_one("#ranks", DataTable).row_count == 70  # the table still lists all


@asynctest
async def test_saturated_host_is_a_live_finding(tmp_path: Path) -> None:
    app = make_app(build(str(tmp_path / "hot.db"), SynthSpec(saturated_node=1)))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        assert app.analysis_count >= 1
        await press(pilot, "v")
        findings = static_text(app.screen, "#verdicts")
        assert "HOST_MEM_SATURATED [node 1]" in findings and "HOST_CPU_SATURATED [node 1]" in findings
        assert "[node 0]" not in findings
