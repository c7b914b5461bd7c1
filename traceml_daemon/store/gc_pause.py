"""Pause the cyclic garbage collector around a bulk read (and, held from open()
to close(), for the daemon's writer: see IngestPolicy.gc_interval_s).

Loading a run builds millions of small acyclic objects (row tuples, column
lists) that all survive: every young collection walks them again and full
collections, triggered by the survivors, walk the whole heap each time. The
final summary of 4096 ranks spent 28 of its 64 s in 59 full collections
(measured, bench/ingest.py paced 4096 ranks, 240 s). Nothing these reads build
is a cycle, so reference counting frees it all; the collector is restored on
exit, whatever it was.
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
