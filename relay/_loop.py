"""Event loop choice: uvloop when it is importable, the stdlib loop otherwise.

uvloop is an optional speed-up (it is absent on Windows and in slim images); the
relay must behave identically without it, so this is the only place that knows.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on the preferred loop."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(coro)
