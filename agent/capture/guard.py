"""Fail-open guard: count every failure by kind, warn once per kind.

The capture code runs inside the user's training step (hooks, patches); an
exception escaping it would crash training for a telemetry bug, so every
entry point catches and reports here instead.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any


class ErrorGate:
    def __init__(self, warn: Callable[[str, str], None]) -> None:
        # warn(kind, message): the kind lets the caller keep one "first warning" per
        # kind; the message carries no "[traceml]" prefix (the caller's printer adds it).
        self._warn = warn
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}

    def fail(self, kind: str, exc: BaseException | None = None) -> None:
        """Count one failure of ``kind``; the first of each kind is reported. Never raises."""
        try:
            with self._lock:
                first = kind not in self.counts
                self.counts[kind] = self.counts.get(kind, 0) + 1
            if first:
                detail = f": {exc.__class__.__name__}: {exc}" if exc is not None else ""
                self._warn(kind, f"tracer {kind} failed{detail} (further failures of this kind are only counted)")
        except Exception:  # a broken warn callback must not break training either
            pass

    def notice(self, kind: str, message: str) -> None:
        """One line for the user, not a failure: not counted here, and its kind is
        "notice:" + ``kind`` so the caller's printer (agent.tracer_build) does not count it either."""
        try:
            self._warn("notice:" + kind, message)
        except Exception:
            pass

    def total(self) -> int:
        with self._lock:
            return sum(self.counts.values())


def remove_handles(handles: Iterable[Any]) -> None:
    """Remove torch hook handles, ignoring any that fail: undoing our hooks
    must never raise into the training process."""
    for handle in handles:
        try:
            handle.remove()
        except Exception:
            pass
