"""Fixtures for the TUI tests: databases built from rows, and a way to wait
until the app's refresh worker has painted (no sleeps on wall-clock time)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from textual.pilot import Pilot
from textual.widgets import DataTable, Static

from tests.support.synth_db import T0, SynthSpec, build
from traceml_daemon.tui.app import TraceApp

FROZEN_NOW = T0 + 3600.0  # "now" for every app in these tests: uptime never moves


@pytest.fixture
def tui_db(tmp_path: Path) -> str:
    """2 nodes x 2 ranks FSDP2 run with system/gpu rows (some absent), scalars, layers, models."""
    return build(str(tmp_path / "run.db"), SynthSpec(parallelism="fsdp2"))


def make_app(db: str) -> TraceApp:
    # refresh_s=0: refresh only on mount and navigation, so screens are deterministic.
    return TraceApp(db, clock=lambda: FROZEN_NOW, refresh_s=0)


async def settle(pilot: Pilot[None], n: int = 1) -> None:
    """Wait until at least ``n`` refreshes completed and no read or analysis is in flight."""
    app = pilot.app
    assert isinstance(app, TraceApp)
    for _ in range(500):
        idle = not app._busy and not app._pending and not app._analysis_due and not app._analyzing
        if app.refresh_count >= n and idle:
            break
        await pilot.pause(0.01)
    await app.workers.wait_for_complete()
    await pilot.pause()
    # A DataTable measures its columns on the next Idle after rows change, then lays out
    # again: a picture taken before that has the header at the old widths (a snapshot
    # failed so once in CI, "fwd  bwd" over cells of "10.0  20.0").
    for _ in range(500):
        if not any(t._updated_cells or t._require_update_dimensions for t in app.screen.query(DataTable)):
            break
        await pilot.pause(0.01)
    await pilot.pause()


async def press(pilot: Pilot[None], *keys: str) -> None:
    """Press ``keys``, then wait for the screen to settle (see ``settle``)."""
    await pilot.press(*keys)
    await settle(pilot)


def asynctest(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test body with asyncio.run (no async pytest plugin is installed)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        asyncio.run(fn(*args, **kwargs))

    return wrapper


def static_text(screen: object, selector: str) -> str:
    """What the Static widget at ``selector`` on ``screen`` renders, as plain text."""
    return str(screen.query_one(selector, Static).render())  # type: ignore[attr-defined]
