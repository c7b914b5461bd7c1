"""The Rollouts screen (key ``o``) on a database holding an RL run's sessions: figures,
statuses, the oldest pending session with its age, reasons and the rollout verdicts."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from textual.widgets import Input

from tests.traceml_daemon.tui.conftest import FROZEN_NOW, asynctest, make_app, press, settle, static_text
from traceml_daemon.store.migrate import migrate
from traceml_daemon.tui.screens import RankScreen
from traceml_daemon.tui.screens.rollouts import RolloutsScreen


def _rollout_db(path: Path) -> str:
    migrate(str(path))
    con = sqlite3.connect(path)
    con.execute("INSERT INTO ranks (rank_id, sender, session, attempt, global_rank, local_rank, node_rank, "
                "world_size, first_seen, last_seen) VALUES (1, 's/r0', 'rl-run', 0, 0, 0, 0, 1, ?, ?)",
                (FROZEN_NOW - 100, FROZEN_NOW))
    t0 = FROZEN_NOW - 90
    sessions, phases = [], []
    for sid in range(1, 61):
        submit = t0 + sid * 0.5
        gen = 0.02 if sid % 20 else 1.5  # a long tail
        status, reason = ("rejected", "stale_weight") if sid % 2 else ("accepted", None)
        sessions.append((1, sid // 4, sid, "pending", None, submit, None, None))
        sessions.append((1, sid // 4, sid, status, reason, submit, submit + gen + 0.01, 0))
        phases.append((1, sid, "generate", submit, submit + gen, None, None))
    sessions.append((1, 99, 61, "pending", None, FROZEN_NOW - 80, None, None))  # stuck
    con.executemany("INSERT INTO rollout_sessions (rank_id, task_id, session_id, status, reason, submit_ts, "
                    "finalized_ts, open_phases) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", sessions)
    con.executemany("INSERT INTO session_phases (rank_id, session_id, phase, start_ts, end_ts, start_payload, "
                    "end_payload) VALUES (?, ?, ?, ?, ?, ?, ?)", phases)
    con.execute("INSERT INTO profiles (rank_id, step, steps, ts, path) VALUES (1, 49, 1, ?, '/data/p/rank0-step49.json')",
                (FROZEN_NOW - 50,))
    con.commit()
    con.close()
    return str(path)


@asynctest
async def test_rollouts_screen_shows_figures_pending_and_verdicts(tmp_path: Path) -> None:
    app = make_app(_rollout_db(tmp_path / "rl.db"))
    async with app.run_test(size=(100, 40)) as pilot:
        await settle(pilot)
        await press(pilot, "o")
        screen = app.screen
        assert isinstance(screen, RolloutsScreen)
        for _ in range(200):
            if screen.loads:
                break
            await pilot.pause(0.02)
        summary = screen.summary
        assert summary is not None
        assert summary["sessions"] == 61 and summary["pending"] == 1
        assert summary["statuses"] == {"accepted": 30, "rejected": 30, "pending": 1}
        assert [p["session_id"] for p in summary["oldest_pending"]] == [61]
        names = {v["name"] for v in summary["verdicts"]}
        assert {"ROLLOUT_LONG_TAIL", "ROLLOUT_REJECTIONS_HIGH", "ROLLOUT_SESSIONS_STUCK"} <= names
        text = str(screen.query_one("#rollouts").render())
        assert "generate" in text and "stale_weight" in text and "session 61" in text
        await press(pilot, "escape")
        assert not isinstance(app.screen, RolloutsScreen)


@asynctest
async def test_rank_screen_lists_the_profiler_traces(tmp_path: Path) -> None:
    app = make_app(_rollout_db(tmp_path / "rl.db"))
    async with app.run_test(size=(100, 40)) as pilot:
        await settle(pilot)
        await pilot.press("slash")
        app.screen.query_one(Input).value = "r0"
        await press(pilot, "enter")
        assert isinstance(app.screen, RankScreen)
        text = static_text(app.screen, "#profiles")
        assert "torch.profiler traces" in text and "step 49 (1 steps): /data/p/rank0-step49.json" in text
