"""The newest N numbers of a series, stored flat (the rings of ``analysis.rolling``).

A ``deque`` of Python ints is several times larger per value and a container
the cyclic GC walks value by value, at every full collection, across every
rank's series; an ``array`` holds 8 bytes per value and nothing the GC looks
into. Integer series (nanoseconds) use ``typecode="q"``, so ints are stored as
they are instead of through a temporary float each.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from typing import Any

from traceml_wire.tables import INT64_MAX, INT64_MIN


class Ring:
    __slots__ = ("maxlen", "_buf")

    def __init__(self, maxlen: int, typecode: str = "d") -> None:
        if maxlen <= 0:
            raise ValueError("maxlen must be positive")
        self.maxlen = maxlen
        self._buf = array(typecode)

    def extend(self, values: Sequence[float | None]) -> None:
        """Append ``values`` (numbers; ints for an int64 ring), skipping None ("not
        measured"); only the newest ``maxlen`` are kept. An int64 ring clamps a value
        beyond its range.

        The usual case (no None, in range) converts the kept values into an array of
        their own, sized once, and appends it with one copy: ``array.extend`` of a list
        or tuple appends value by value, regrowing the buffer as it goes, and took twice
        as long for 64 values (aggregates extend eight rings per rank and fold). A None
        or an out-of-range value makes the conversion raise before the buffer is
        touched, and only then are values filtered, so the common path never scans
        for None."""
        buf = self._buf
        try:
            buf += array(buf.typecode, values[-self.maxlen :])
        except (TypeError, OverflowError):
            kept = [v for v in values if v is not None][-self.maxlen :]
            if buf.typecode == "q":  # a difference of two extreme int64 values, or a float
                kept = [int(min(max(v, INT64_MIN), INT64_MAX)) for v in kept]
            buf.extend(kept)
        # Trim in amortised O(1): let the buffer reach twice the window, then cut.
        if len(buf) >= 2 * self.maxlen:
            del buf[: len(buf) - self.maxlen]

    def values(self) -> array[Any]:
        return self._buf[-self.maxlen :]

    def median(self) -> float | None:
        """The median of the kept values (statistics.median's), None when there are none."""
        buf, m = self._buf, self.maxlen
        n = len(buf)
        if not n:
            return None
        xs = sorted(buf[n - m :] if n > m else buf)
        n = len(xs)
        mid = n // 2
        return xs[mid] if n % 2 else (xs[mid - 1] + xs[mid]) / 2

    def __len__(self) -> int:
        return min(len(self._buf), self.maxlen)

    def __bool__(self) -> bool:
        return len(self._buf) > 0

    def __iter__(self) -> Iterator[float]:
        return iter(self.values())
