"""Where the daemon's memory goes, logged while it runs (diagnosis only; off by default).

Set ``TRACEML_DEBUG_MEM=SECONDS`` and the daemon logs, every SECONDS, its
resident memory split into anonymous and file-backed (``/proc/self/smaps_rollup``),
glibc's malloc totals (``mallinfo2``: in use, free in arenas, mmapped), sqlite's
own allocator (``sqlite3_memory_used``), the sizes of the writer's long-lived
maps, and GC counts. ``TRACEML_DEBUG_MEM_TRACE=1`` adds tracemalloc and logs the
allocation sites that grew most since the previous report (it costs CPU; use it
to find a leak, never to measure speed).

Growth of RSS with flat Python allocations and flat sqlite memory points at the
allocator (fragmentation, arenas), not at a data structure.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import gc
import logging
import os
import tracemalloc
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger("traceml_daemon.net.memdebug")

ENV_INTERVAL = "TRACEML_DEBUG_MEM"
ENV_TRACE = "TRACEML_DEBUG_MEM_TRACE"


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")
    ]


@functools.cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def _sqlite_lib() -> Any:
    """The libsqlite3 Python's sqlite3 module uses (dlsym on the extension's handle
    searches its dependencies too)."""
    import _sqlite3

    try:
        lib = ctypes.CDLL(_sqlite3.__file__)
        lib.sqlite3_memory_used.restype = ctypes.c_int64
        lib.sqlite3_memory_highwater.restype = ctypes.c_int64
        return lib
    except (OSError, AttributeError):
        return None


def interval_from_env(environ: Mapping[str, str] = os.environ) -> float | None:
    """Seconds between reports from ``TRACEML_DEBUG_MEM``; None when unset or not a
    positive number (the latter is logged: a typo must not end the daemon)."""
    raw = environ.get(ENV_INTERVAL, "").strip()
    if not raw:
        return None
    try:
        interval = float(raw)
    except ValueError:
        interval = 0.0
    if not interval > 0 or interval == float("inf"):
        log.warning("%s=%r is not a positive number of seconds; memory reports are off "
                    "(set it to e.g. 30)", ENV_INTERVAL, raw)
        return None
    return interval


def rss_split(pid: int | str = "self") -> tuple[int, int]:
    """(anonymous, file-backed) resident KiB of process ``pid``; (0, 0) off Linux or
    once the process is gone. Heap growth shows as anonymous memory, sqlite's
    mapped or cached file pages as file-backed."""
    anon = rss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key == "Anonymous":
                    anon = int(rest.split()[0])
                elif key == "Rss":
                    rss = int(rest.split()[0])
    except OSError:
        return 0, 0
    return anon, max(0, rss - anon)


def mallinfo() -> dict[str, int] | None:
    libc = _libc()
    fn = getattr(libc, "mallinfo2", None) if libc is not None else None
    if fn is None:
        return None
    fn.restype = _MallInfo2
    info = fn()
    return {"arena": info.arena, "mmapped": info.hblkhd, "in_use": info.uordblks, "free": info.fordblks}


async def report_forever(interval: float, sizes: Callable[[], dict[str, int]]) -> None:
    """Log a memory report every ``interval`` s; ``sizes()`` returns the daemon's map sizes."""
    trace = os.environ.get(ENV_TRACE) == "1"
    if trace and not tracemalloc.is_tracing():
        tracemalloc.start(8)
    sqlite = _sqlite_lib()
    previous: tracemalloc.Snapshot | None = None
    while True:
        await asyncio.sleep(interval)
        anon, file = rss_split()
        parts = [f"rss anon {anon // 1024} MB file {file // 1024} MB"]
        info = mallinfo()
        if info is not None:
            parts.append("malloc " + " ".join(f"{k} {v >> 20} MB" for k, v in info.items()))
        if sqlite is not None:
            parts.append(f"sqlite used {sqlite.sqlite3_memory_used() >> 20} MB "
                         f"high {sqlite.sqlite3_memory_highwater(0) >> 20} MB")
        parts.append(f"gc {gc.get_count()} frozen {gc.get_freeze_count()}")
        parts.append(" ".join(f"{k} {v}" for k, v in sizes().items()))
        if trace:
            traced, peak = tracemalloc.get_traced_memory()
            parts.append(f"traced {traced >> 20} MB peak {peak >> 20} MB")
        log.warning("memdebug: %s", "; ".join(parts))
        if trace:
            snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
            if previous is not None:
                for stat in snap.compare_to(previous, "lineno")[:12]:
                    log.warning("memdebug growth: %s", stat)
            previous = snap
