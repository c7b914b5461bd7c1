"""Run a coroutine on uvloop when it is installed, else on the stdlib loop.

uvloop roughly halves per-frame overhead for the daemon's socket work, but it
is optional (absent on Windows), so every entry point goes through here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def uvloop_available() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on the fastest loop available."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    # asyncio.Runner with a loop factory keeps us off the deprecated policy API.
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
