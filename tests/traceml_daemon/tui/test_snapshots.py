"""SVG snapshots of each screen at 80x24 and 200x50.

The clock is frozen and the analysis engine is replaced by a fixed one, so the
pictures change only when the TUI does. Regenerate with ``--snapshot-update``.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from textual.pilot import Pilot

from tests.traceml_daemon.tui.conftest import make_app, press, settle
from traceml_daemon.analysis.model import RunData, Verdict


def _fixed_diagnose(run: RunData, policy: object = None) -> list[Verdict]:
    return [
        Verdict(
            "STRAGGLER_RANK",
            "warn",
            {"global_rank": 3},
            "rank 3 forward is 40% slower than the median rank (14.0 ms vs 10.0 ms)",
            {"forward_ms": 14.0, "median_forward_ms": 10.0, "ranks": len(run.ranks)},
            "check rank 3's GPU clocks and input shapes",
        ),
        Verdict("COMPUTE_BOUND", "info", {}, "forward+backward+optimizer take 81% of the step"),
    ]


@pytest.fixture(autouse=True)
def fixed_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = types.ModuleType("traceml_daemon.analysis.engine")
    engine.diagnose = _fixed_diagnose  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "traceml_daemon.analysis.engine", engine)


def _keys(*keys: str) -> Callable[[Pilot[None]], Awaitable[None]]:
    async def run_before(pilot: Pilot[None]) -> None:
        await settle(pilot)
        for key in keys:
            await press(pilot, key)

    return run_before


SCREENS = {
    "overview": (),
    "node": ("enter",),
    "rank": ("tab", "down", "down", "down", "enter"),
    "verdicts": ("v",),
    "phase": ("p", "p", "p"),
}


@pytest.mark.parametrize("size", [(80, 24), (200, 50)], ids=["80x24", "200x50"])
@pytest.mark.parametrize("screen", list(SCREENS))
def test_snapshot(snap_compare: Any, tui_db: str, screen: str, size: tuple[int, int]) -> None:
    assert snap_compare(make_app(tui_db), terminal_size=size, run_before=_keys(*SCREENS[screen]))
