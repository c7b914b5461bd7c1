"""The process-wide settings the writer makes for itself: GIL hand-offs, garbage
collection on a timer, and heap trimming.

* The writer thread must get the GIL back quickly after each ``sqlite3_step``, so
  the switch interval is lowered (``IngestPolicy.gil_switch_interval``).
* Ingest allocates many short-lived containers that reference counting frees, and
  the cyclic collector walking them cost much CPU: automatic collection is off
  from ``start`` to ``stop``, and ``maybe_collect_garbage`` runs a full collection
  every ``IngestPolicy.gc_interval_s`` (figures: docs/performance.md).
* After a history write, ``trim_heap`` hands malloc's free pages back to the system.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import logging
import sys
import time
from collections.abc import Callable

from traceml_daemon.store.gc_pause import gc_paused
from traceml_daemon.store.policy import IngestPolicy

log = logging.getLogger("traceml_daemon.writer")


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, where there is one."""
    name = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None


def trim_heap() -> None:
    """Hand the heap's free pages back to the system (glibc only; else nothing)."""
    if (malloc_trim := _malloc_trim()) is not None:
        malloc_trim(0)  # a ctypes call: the GIL is released meanwhile


class ProcessHygiene:
    """GIL switch interval and timed garbage collection, from ``start`` to ``stop``."""

    def __init__(self, policy: IngestPolicy) -> None:
        self.policy = policy
        self.next_gc = float("inf")  # when maybe_collect_garbage collects next
        self._gc_pause = contextlib.ExitStack()

    def start(self) -> None:
        # Process-wide, and deliberate: the daemon's writer thread must get the GIL
        # back quickly after each sqlite3_step.
        sys.setswitchinterval(min(sys.getswitchinterval(), self.policy.gil_switch_interval))
        # Also process-wide: collection on a timer instead of allocation counts, and
        # what exists at start (modules, classes) is never walked again. stop() turns
        # automatic collection back on.
        gc.freeze()
        self._gc_pause.enter_context(gc_paused())
        self.next_gc = time.monotonic() + self.policy.gc_interval_s

    def stop(self) -> None:
        self.next_gc = float("inf")
        self._gc_pause.close()  # automatic collection as it was before start()

    def maybe_collect_garbage(self) -> int | None:
        """A full cyclic collection when one is due (see IngestPolicy.gc_interval_s);
        returns the unreachable objects it found, or None when none was due."""
        now = time.monotonic()
        if now < self.next_gc:
            return None
        found = gc.collect()
        self.next_gc = time.monotonic() + self.policy.gc_interval_s
        log.debug("garbage collection: %d unreachable objects, %.1f ms", found, 1000 * (time.monotonic() - now))
        return found
