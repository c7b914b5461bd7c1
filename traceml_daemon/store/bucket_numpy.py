"""Per-bucket column statistics with numpy, for long runs of one rank's steps.

The history fold (``history.add_rank_deltas``) needs, for every bucket of 64
consecutive steps, each metric's count, min, max and sum. In plain Python that
is a handful of C-level passes per column per bucket plus the slicing, ~1 us a
row in all, and it runs holding the GIL on the database thread, so at 3,000+
steps per rank flush it was the largest share of that thread (py-spy, bench/ingest.py
R=64 at 3333 steps a flush: 39% of its samples). Here a column is converted once
and reduced over all its buckets at once.

Only what numpy computes exactly is taken: a column of int64 integers whose
bucket sums cannot overflow, or a numeric column with no NaN for a max. Anything
else (a ``None`` for "not measured", floats in an int column, out-of-range
values, strings) returns None and the caller takes its exact Python path, so the figures stored
never depend on which path ran (tests/traceml_daemon/test_history.py).

numpy is optional: without it ``AVAILABLE`` is False and every fold is Python.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

try:
    import numpy as np
except ImportError:  # pragma: no cover - the pure path does the same, slower
    np = None

AVAILABLE = np is not None


def int_quads(column: Sequence[Any], starts: Sequence[int], bound: int) -> list[tuple[int, int, int, int]] | None:
    """(count, min, max, sum) per bucket ``[starts[i], starts[i + 1])`` (the last runs
    to the end) of an integer column; None unless every value is an int (bools count
    as the ints they are, as Python's sum does) whose magnitude is at most ``bound``
    (the caller's guarantee that a bucket's sum fits in an int64)."""
    try:
        # array('q') takes ints alone (a float, a None or a string raises, a value past
        # int64 overflows) at about half np.array's cost per value.
        arr = np.frombuffer(array("q", column), dtype=np.int64)
    except (TypeError, OverflowError):
        return None
    if not arr.size or int(arr.max()) > bound or int(arr.min()) < -bound:
        return None
    idx = np.asarray(starts, dtype=np.intp)
    return list(zip(
        np.diff(idx, append=arr.size).tolist(),
        np.minimum.reduceat(arr, idx).tolist(),
        np.maximum.reduceat(arr, idx).tolist(),
        np.add.reduceat(arr, idx).tolist(),
        strict=True,
    ))


def real_maxima(column: Sequence[Any], starts: Sequence[int]) -> list[float] | None:
    """The max of each bucket of a numeric column (ints read as floats); None unless
    every value is a number and none is NaN."""
    try:
        arr = np.frombuffer(array("d", column), dtype=np.float64)
    except (TypeError, OverflowError):
        return None
    if not arr.size or np.isnan(arr).any():
        return None
    return np.maximum.reduceat(arr, np.asarray(starts, dtype=np.intp)).tolist()
