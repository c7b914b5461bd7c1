"""Log lines that a peer can make a process repeat, held to a rate (pure; the
caller prints).

A relay inside a training process refuses whatever knocks on its port, and an
agent is refused for as long as its relay says no: each repeat would be a line
on the trainer's stderr. ``LineLimiter`` lets the first line of a kind through,
then at most one per ``interval`` saying how many it held back meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Callable

DEFAULT_INTERVAL_S = 60.0


class LineLimiter:
    def __init__(self, interval: float = DEFAULT_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._kinds: dict[str, tuple[float, int]] = {}  # kind -> (when its last line went out, held back since)

    def line(self, kind: str, message: str) -> str | None:
        """The line to print now for ``message`` of ``kind``, or None to stay quiet."""
        now = self._clock()
        last = self._kinds.get(kind)
        if last is not None:
            when, held = last
            if now - when < self.interval:
                self._kinds[kind] = (when, held + 1)
                return None
            if held:
                message = f"{message} (and {held} more like it since the last such line)"
        self._kinds[kind] = (now, 0)
        return message

    def held_back(self, kind: str) -> int:
        """Lines of ``kind`` held back since the last one printed."""
        last = self._kinds.get(kind)
        return last[1] if last is not None else 0
