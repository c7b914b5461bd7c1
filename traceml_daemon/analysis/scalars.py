"""Logged scalar series (``agent.log``): their keys and what they say about numerics."""

from __future__ import annotations

import math

from traceml_daemon.analysis.model import NonFinite

_SEP = "@"


def scalar_key(name: str, rank: int | None) -> str:
    """'loss@0' for rank 0; the rank goes last so names may hold '@' or '/'."""
    return name if rank is None else f"{name}{_SEP}{rank}"


def split_key(key: str) -> tuple[str, int | None]:
    name, sep, rank = key.rpartition(_SEP)
    if sep and rank.lstrip("-").isdigit():
        return name, int(rank)
    return key, None


def first_nonfinite(scalars: dict[str, list[tuple[int, float]]]) -> list[NonFinite]:
    """The first non-finite value of each (scalar, rank) series, keyed by ``scalar_key``."""
    out: list[NonFinite] = []
    for key, series in scalars.items():
        bad = [(step, value) for step, value in series if not math.isfinite(value)]
        if bad:
            name, rank = split_key(key)
            step, value = min(bad, key=lambda sv: sv[0])
            out.append(NonFinite(global_rank=rank if rank is not None else -1, name=name, step=step, value=value))
    return out
