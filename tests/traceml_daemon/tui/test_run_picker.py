"""The TUI with two jobs on one daemon: it stays on its run when another starts, says
so, and shows another run when asked (the run picker, ``r``), or the one ``--session``
pins. The database is the real daemon's, fed by two relays of different sessions."""

from __future__ import annotations

from pathlib import Path

from textual.widgets import DataTable

from tests.support.procs import DaemonProcess
from tests.traceml_daemon.commands.two_jobs import JOB_A, JOB_B, Relay, send_interleaved
from tests.traceml_daemon.tui.conftest import FROZEN_NOW, asynctest, make_app, press, settle, static_text
from traceml_daemon.tui.app import TraceApp
from traceml_daemon.tui.screens import NodeScreen, OverviewScreen, RunsScreen


def notices(app: TraceApp) -> list[str]:
    return [n.message for n in app._notifications]


@asynctest
async def test_a_new_run_is_announced_not_switched_to_and_the_picker_switches(tmp_path: Path) -> None:
    db = tmp_path / "head.db"
    with DaemonProcess(db) as daemon:
        first = Relay(daemon.port, JOB_A)
        first.send(0)  # job A is the only run when the TUI opens
        app = make_app(str(db))
        async with app.run_test(size=(100, 30)) as pilot:
            await settle(pilot)
            header = static_text(app.screen, "#header")
            assert JOB_A.session in header and f"{JOB_A.ranks} ranks" in header
            assert "new run" not in header

            # Job B starts while the view follows job A; both keep sending.
            second = Relay(daemon.port, JOB_B)
            second.send(0)
            first.send(10)
            second.send(10)
            app.request_refresh()
            await settle(pilot, app.refresh_count + 1)
            header = static_text(app.screen, "#header")
            assert JOB_A.session in header and f"{JOB_A.ranks} ranks" in header and "step 19" in header
            assert f"new run: {JOB_B.session}" in header and "r: pick a run" in header
            assert [n for n in notices(app) if JOB_B.session in n] == [
                f"new run {JOB_B.session} started (r: pick a run to show)"]

            # A second refresh does not announce it again.
            app.request_refresh()
            await settle(pilot, app.refresh_count + 1)
            assert len([n for n in notices(app) if JOB_B.session in n]) == 1

            # The picker, opened from a node screen: both runs, oldest first, after "follow".
            await press(pilot, "enter")
            assert isinstance(app.screen, NodeScreen)
            await press(pilot, "r")
            assert isinstance(app.screen, RunsScreen)
            table = app.screen.query_one("#runs", DataTable)
            names = [str(table.get_row_at(i)[1]) for i in range(table.row_count)]
            assert names == ["follow the latest run", JOB_A.session, f"{JOB_B.session} (latest)"]
            await press(pilot, "down", "down", "enter")
            assert isinstance(app.screen, OverviewScreen)
            await settle(pilot, app.refresh_count + 1)
            header = static_text(app.screen, "#header")
            assert JOB_B.session in header and f"{JOB_B.ranks} ranks" in header and "step 19" in header
            assert "new run" not in header  # the run it announced is the one shown
            assert app.data.run is not None and app.data.run.session == JOB_B.session

            # Escape leaves the picker without a change; "follow" goes back to the latest run.
            await press(pilot, "r")
            await press(pilot, "escape")
            assert isinstance(app.screen, OverviewScreen) and app.data.choice.pinned == JOB_B.session
            await press(pilot, "r")
            await press(pilot, "enter")  # the cursor starts on the run shown; up to "follow"
            assert app.data.choice.pinned == JOB_B.session
            await press(pilot, "r")
            await press(pilot, "up", "up", "enter")
            await settle(pilot, app.refresh_count + 1)
            assert app.data.choice.pinned is None and app.data.run is not None
            assert app.data.run.session == JOB_B.session  # the latest
        first.close()
        second.close()


@asynctest
async def test_session_pins_a_run_that_is_not_the_latest(tmp_path: Path) -> None:
    db = tmp_path / "head.db"
    with DaemonProcess(db) as daemon:
        send_interleaved(daemon.port)
    app = TraceApp(str(db), clock=lambda: FROZEN_NOW, refresh_s=0, session=JOB_A.session)
    async with app.run_test(size=(100, 30)) as pilot:
        await settle(pilot)
        header = static_text(app.screen, "#header")
        assert JOB_A.session in header and f"{JOB_A.ranks} ranks" in header and f"step {JOB_A.steps - 1}" in header
        assert "new run" not in header  # job B was there before the view opened
        assert app.analysis_count >= 1 and app.analysis is not None
        assert {r.global_rank for r in app.last_snapshot.overview.ranks} == set(range(JOB_A.ranks))  # type: ignore[union-attr]
    # Without it, the latest run.
    app = make_app(str(db))
    async with app.run_test(size=(100, 30)) as pilot:
        await settle(pilot)
        assert JOB_B.session in static_text(app.screen, "#header")
