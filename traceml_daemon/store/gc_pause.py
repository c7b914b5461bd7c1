"""Pause the cyclic garbage collector around a bulk read (and, held from open()
to close(), for the daemon's writer: see IngestPolicy.gc_interval_s).

Loading a run builds millions of small acyclic objects that all survive, and
the collections they trigger walk the whole heap again and again (figures:
docs/performance.md). Nothing these reads build is a cycle, so reference
counting frees it all; the collector is restored on exit, whatever it was.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
