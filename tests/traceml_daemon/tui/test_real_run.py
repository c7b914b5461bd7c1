"""The TUI against a database written by a real run (``real_run_db``: a real
daemon, ``torchrun --nproc-per-node 2`` gloo DDP, rank 1 with a slow collate),
not against rows the synthetic builder chose. Driven by Pilot at 80x24."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from textual.widgets import DataTable, Input

from tests.conftest import REAL_RUN_STEPS
from tests.support.synth_db import SynthSpec, build
from tests.traceml_daemon.tui.conftest import asynctest, make_app, press, settle, static_text
from traceml_daemon.analysis.model import PHASES
from traceml_daemon.tui.screens import JumpScreen, NodeScreen, OverviewScreen, RankScreen, VerdictsScreen
from traceml_daemon.tui.widgets import RankGrid, SparkList

pytestmark = pytest.mark.slow


def _keys(table: DataTable[object]) -> list[str]:
    return [str(table.coordinate_to_cell_key((i, 0)).row_key.value) for i in range(table.row_count)]


@asynctest
async def test_real_run_overview_drill_down_findings_jump_and_quit(real_run_db: Path) -> None:
    ro = sqlite3.connect(f"file:{real_run_db}?mode=ro", uri=True)
    session, hostname = ro.execute("SELECT session, hostname FROM ranks ORDER BY global_rank LIMIT 1").fetchone()
    ro.close()
    app = make_app(str(real_run_db))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        assert isinstance(app.screen, OverviewScreen) and app.analysis_count >= 1
        header = static_text(app.screen, "#header")
        assert session in header and "2 ranks on 1 node" in header and "  ddp  " in header
        assert f"step {REAL_RUN_STEPS - 1}" in header and "finished" in header and "delivery: no loss" in header
        # Rank 1's collate sleeps 15 ms a step: the live analysis names it first.
        banner = static_text(app.screen, "#banner")
        assert "INPUT_STRAGGLER" in banner and "rank 1" in banner
        assert "2 ranks" in str(app.screen.query_one(RankGrid).render())
        nodes = app.screen.query_one("#nodes", DataTable)
        assert nodes.row_count == 1 and [str(c) for c in nodes.get_row_at(0)][:3] == ["n0", hostname, "2"]
        assert _keys(app.screen.query_one("#ranks", DataTable)) == ["0", "1"]

        await pilot.press("enter")  # the nodes table has the focus: node 0
        await settle(pilot)
        assert isinstance(app.screen, NodeScreen) and app.screen.node_rank == 0
        assert "Node 0" in static_text(app.screen, "#title") and "2 ranks" in static_text(app.screen, "#title")
        assert [line[0] for line in app.screen.query_one("#sparks", SparkList).lines] == ["r0", "r1"]
        assert "showing" not in static_text(app.screen, "#sparks_title")  # every rank has its line
        assert _keys(app.screen.query_one("#ranks", DataTable)) == ["0", "1"]

        await press(pilot, "down", "enter")
        assert isinstance(app.screen, RankScreen) and app.screen.global_rank == 1
        title = static_text(app.screen, "#title")
        assert "Rank 1  node 0 local 1" in title and f"steps {REAL_RUN_STEPS}" in title
        assert [line[0] for line in app.screen.query_one("#phases", SparkList).lines] == list(PHASES)
        assert "(ddp)" in static_text(app.screen, "#models")

        await press(pilot, "escape")
        assert isinstance(app.screen, NodeScreen)
        await press(pilot, "escape")
        assert isinstance(app.screen, OverviewScreen)

        await press(pilot, "v")
        assert isinstance(app.screen, VerdictsScreen)
        assert "INPUT_STRAGGLER [rank 1, node 0]" in static_text(app.screen, "#verdicts")
        delivery = static_text(app.screen, "#delivery")
        assert "rows dropped 0  batches dropped 0  spooled 0" in delivery
        assert "frames_received" in delivery and "dropped_bytes 0" in delivery
        await press(pilot, "escape")

        for query, screen, key in (("r1", RankScreen, "global_rank"), ("n0", NodeScreen, "node_rank")):
            await pilot.press("slash")
            assert isinstance(app.screen, JumpScreen)
            app.screen.query_one(Input).value = query
            await press(pilot, "enter")
            assert isinstance(app.screen, screen) and getattr(app.screen, key) == int(query[1:])
        assert "Node 0" in static_text(app.screen, "#title")
        await pilot.press("slash")
        app.screen.query_one(Input).value = "r2"  # a 2-rank run has no rank 2
        await press(pilot, "enter")
        assert isinstance(app.screen, NodeScreen)

        await pilot.press("q")
        await pilot.pause()
        assert app.return_code == 0


def _counter_names(db: str) -> dict[str, set[str]]:
    ro = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    out: dict[str, set[str]] = {}
    for source, counter in ro.execute("SELECT source, counter FROM delivery"):
        out.setdefault(str(source).split(":", 1)[0], set()).add(str(counter))
    ro.close()
    return out


def test_synth_stores_the_counter_names_of_a_real_run(real_run_db: Path, tmp_path: Path) -> None:
    synth = build(str(tmp_path / "synth.db"), SynthSpec(with_detail=False))
    real = _counter_names(str(real_run_db))
    assert set(real) == {"daemon", "relay", "agent"}
    assert _counter_names(synth) == real
