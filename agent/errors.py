"""Fail-open error reporting for the agent.

Nothing in the agent may raise into user code, yet silent failure hides real
problems. The compromise: every failure is counted by kind, and the first one
of each kind prints a single ``[traceml]`` line on stderr (no traceback), so a
job with the daemon down logs one line, not one per step.
"""

from __future__ import annotations

import sys
import threading

PREFIX = "[traceml]"


class ErrorReporter:
    """Counts failures per kind and prints the first message of each kind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self._warned: set[str] = set()

    def report(self, kind: str, message: str) -> bool:
        """Count one failure of ``kind``; print ``message`` if it is the first.

        Returns True when the message was printed. Never raises: a closed or
        broken stderr must not turn a telemetry hiccup into a training crash.
        """
        with self._lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            first = kind not in self._warned
            self._warned.add(kind)
        if first:
            try:
                sys.stderr.write(f"{PREFIX} {message}\n")
                sys.stderr.flush()
            except Exception:  # stderr closed or replaced by something odd
                pass
        return first

    def notice(self, kind: str, message: str) -> bool:
        """Print ``message`` once per kind, like ``report``, without counting a failure:
        something the user should know that is not an error (a feature skipped)."""
        with self._lock:
            first = kind not in self._warned
            self._warned.add(kind)
        if first:
            try:
                sys.stderr.write(f"{PREFIX} {message}\n")
                sys.stderr.flush()
            except Exception:
                pass
        return first

    def count(self, kind: str) -> None:
        """Count a failure without printing (expected, already explained ones)."""
        with self._lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1

    def total(self) -> int:
        with self._lock:
            return sum(self.counts.values())

    def after_fork(self) -> None:
        """In a forked child: the parent's lock may have been held at fork time.

        Counts and printed kinds are kept, so a DataLoader worker does not
        repeat a warning its parent already printed.
        """
        self._lock = threading.Lock()


# One process-wide reporter: "once per kind" must hold across runtime restarts.
reporter = ErrorReporter()


def warn_once(kind: str, message: str) -> bool:
    return reporter.report(kind, message)
