"""The step inspector and the Logs screen: reached from the overview, a rank and the
findings, over a database built from rows (output rows added as the daemon stores them)."""

from __future__ import annotations

import sqlite3
import sys
import types
from pathlib import Path

import pytest
from textual.pilot import Pilot

from tests.support.synth_db import T0, SynthSpec, build
from tests.traceml_daemon.tui.conftest import asynctest, make_app, press, settle, static_text
from traceml_daemon.analysis.model import RunData, Verdict
from traceml_daemon.store.read.runs import RunRef
from traceml_daemon.tui.evidence import verdict_step
from traceml_daemon.tui.screens import LogsScreen, RankScreen, StepScreen

TB = ["Traceback (most recent call last):", '  File "train.py", line 9, in <module>', "ValueError: bad shard"]


@pytest.fixture
def evidence_db(tmp_path: Path) -> str:
    db = build(str(tmp_path / "run.db"), SynthSpec())
    con = sqlite3.connect(db)
    rows = [(g + 1, T0 + s, "stderr", s, "warning: slow input") for g in range(4) for s in range(3)]
    rows += [(3, T0 + 10 + i, "stderr", 10 + i, line) for i, line in enumerate(TB)]
    con.executemany("INSERT INTO output (rank_id, ts, stream, seq, line) VALUES (?, ?, ?, ?, ?)", rows)
    con.commit()
    con.close()
    return db


def _rank3_verdict(run: RunData, policy: object = None) -> list[Verdict]:
    return [Verdict("COMPUTE_STRAGGLER", "warn", {"global_rank": 3}, "rank 3 is slow in forward")]


@pytest.fixture
def rank3_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = types.ModuleType("traceml_daemon.analysis.engine")
    engine.diagnose = _rank3_verdict  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "traceml_daemon.analysis.engine", engine)


async def _loaded(pilot: Pilot[None], screen: StepScreen | LogsScreen, n: int = 1) -> None:
    for _ in range(500):
        if screen.loads >= n:
            break
        await pilot.pause(0.01)
    await pilot.pause()


@asynctest
async def test_inspector_from_the_overview_and_stepping(evidence_db: str) -> None:
    app = make_app(evidence_db)
    async with app.run_test(size=(160, 60)) as pilot:
        await settle(pilot)
        await pilot.press("i")
        screen = app.screen
        assert isinstance(screen, StepScreen) and screen.rank is None
        await _loaded(pilot, screen)
        assert screen.step == 199
        text = static_text(screen, "#step_view")
        assert "Step 199 of session run-synth" in text and "4 of 4 rank(s) recorded it" in text
        assert all(f"Rank {g} (node {g // 2}" in text for g in range(4))
        assert "the newest step every rank recorded" in static_text(screen, "#header")
        await pilot.press("left")
        await _loaded(pilot, screen, 2)
        assert screen.step == 198 and "Step 198 of session" in static_text(screen, "#step_view")
        await pilot.press("right", "right")
        await _loaded(pilot, screen, 4)
        assert screen.step == 199  # no step 200: the view stays, the message says what exists
        assert "step 200 is not stored for session run-synth: steps 0-199 are stored" in static_text(screen, "#step_view")
        await pilot.press("escape")
        assert not isinstance(app.screen, StepScreen)


@asynctest
async def test_inspector_from_a_rank_and_at_a_verdicts_step(evidence_db: str, rank3_engine: None) -> None:
    app = make_app(evidence_db)
    async with app.run_test(size=(160, 60)) as pilot:
        await settle(pilot)
        await press(pilot, "tab", "down", "down", "down", "enter")
        assert isinstance(app.screen, RankScreen)
        rank = app.screen.global_rank
        await pilot.press("i")
        screen = app.screen
        assert isinstance(screen, StepScreen) and screen.rank == rank
        await _loaded(pilot, screen)
        text = static_text(screen, "#step_view")
        assert f"Rank {rank} (node" in text and text.count("Rank ") == 1
        await pilot.press("escape", "escape")
        await press(pilot, "v")
        await pilot.press("i")
        screen = app.screen
        assert isinstance(screen, StepScreen) and screen.verdict_rank == 3
        await _loaded(pilot, screen)
        assert "rank 3's worst of its newest 64 steps" in static_text(screen, "#header")
        assert screen.step is not None and 136 <= screen.step <= 199


@asynctest
async def test_logs_screen_folds_across_ranks_tracebacks_first(evidence_db: str) -> None:
    app = make_app(evidence_db)
    async with app.run_test(size=(160, 60)) as pilot:
        await settle(pilot)
        await pilot.press("l")
        screen = app.screen
        assert isinstance(screen, LogsScreen)
        await _loaded(pilot, screen)
        lines = static_text(screen, "#logs").splitlines()
        assert lines[0] == "[rank 2 x1] Traceback (most recent call last):"
        assert lines[-1] == "[ranks 0-3 x12] warning: slow input"
        assert "15 lines, 2 distinct" in static_text(screen, "#header")


def test_a_verdicts_step_under_fsdp2_is_where_the_rank_was_busiest_net_of_collective_wait(tmp_path: Path) -> None:
    """Under FSDP2 every rank's step lasts as long: the ranks waiting for rank 3 wait inside
    their collectives (fwd_comm_ns, bwd_comm_ns), not in wait_ns. Only the busy time net of
    that wait shows where rank 3 was slowest."""
    db = build(str(tmp_path / "fsdp2.db"), SynthSpec(parallelism="fsdp2", straggler=None))
    con = sqlite3.connect(db)
    worst = 180
    con.execute("UPDATE steps SET step_ns = 20000000, wait_ns = 0, fwd_comm_ns = 1000000, bwd_comm_ns = 1000000")
    # At step 180 the others waited 8 ms more in forward for rank 3 (rank_id 4); at 170, 3 ms more.
    for step, extra in ((worst, 8_000_000), (170, 3_000_000)):
        con.execute("UPDATE steps SET fwd_comm_ns = 1000000 + ? WHERE step = ? AND rank_id != 4", (extra, step))
    con.commit()
    con.close()
    pick = verdict_step(db, RunRef("run-synth", 0), 3)
    assert pick.step == worst, pick
    assert "+8.0 ms busy" in pick.why
