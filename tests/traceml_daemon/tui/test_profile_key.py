"""The rank screen's P key asks the daemon serving the database for a profile of that rank:
the request goes through the real daemon's request directory; with no daemon, or a rank no
connection carries (this database's run is not live), the notification says what to do.
The live path (a trace arriving) is the CLI's e2e test: both call commands.profile.request."""

from __future__ import annotations

from pathlib import Path

from tests.support.procs import DaemonProcess
from tests.traceml_daemon.tui.conftest import asynctest, make_app, press, settle
from traceml_daemon.tui.app import TraceApp
from traceml_daemon.tui.screens.detail import RankScreen


async def _press_profile(db: str) -> list[str]:
    app = make_app(db)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        await pilot.press("tab")
        await press(pilot, "down", "enter")  # the second rank of the table: global rank 1
        assert isinstance(app.screen, RankScreen) and app.screen.global_rank == 1
        await pilot.press("P")
        await app.workers.wait_for_complete()
        await pilot.pause()
        return _messages(app)


def _messages(app: TraceApp) -> list[str]:
    return [n.message for n in app._notifications]


@asynctest
async def test_without_a_daemon_the_key_says_how_to_start_one(tui_db: str) -> None:
    messages = await _press_profile(tui_db)
    assert any("no daemon serves" in m and "traceml-daemon serve --db" in m for m in messages), messages


def test_a_rank_no_connection_carries_is_named(tui_db: str, tmp_path: Path) -> None:
    with DaemonProcess(Path(tui_db)):
        messages = _run(_press_profile(tui_db))
    assert any("profile rank 1" in m and "not connected" in m and "run finished" in m for m in messages), messages


def _run(coro: object) -> list[str]:
    import asyncio

    return asyncio.run(coro)  # type: ignore[arg-type]
