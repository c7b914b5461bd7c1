"""Resident set size from the cheapest source (read at poll time, never per step)."""

from __future__ import annotations

import os

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def read_rss() -> int | None:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except Exception:
        pass
    try:  # non-Linux
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:
        return None
