"""A rank's step or scalar series, aggregated in SQL into a bounded number of buckets.

Buckets are ``step // size`` with ``size`` a power of two; when there are more
than ``width`` buckets, neighbours are merged pairwise (size doubles), which
needs no re-read. Each update re-aggregates only the newest (possibly partial)
bucket and what came after it, so a refresh costs the steps written since the
previous one and a series never holds more than ``width`` points.
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from traceml_daemon.store.schema import rank_is


@dataclass(frozen=True)
class Series:
    """A downsampled series: ``steps[i]`` is the last step (or ts) of point i."""

    steps: list[float] = field(default_factory=list)
    values: list[float | None] = field(default_factory=list)

    def last(self) -> float | None:
        return self.values[-1] if self.values else None


class Buckets:
    """Cached SQL aggregation of one series of ``table``'s ``cols``.

    ``where`` selects the series' rows with numbered parameters (``?1``...: it is
    used twice in one statement), ``schema.rank_is`` for the rank; ``step_buckets``
    and ``scalar_buckets`` build the two kinds readers use.
    """

    def __init__(self, table: str, cols: Sequence[str], where: str, params: tuple[Any, ...], width: int) -> None:
        self.table = table
        self.cols = tuple(cols)
        self.where = where
        self.params = params
        self.width = max(1, width)
        self.size = 0  # unknown until the first update
        # key -> [count, max_step, sum_c..., n_c...]
        self.buckets: dict[int, list[float]] = {}

    def update(self, con: sqlite3.Connection) -> None:
        if self.size == 0:
            # Two subqueries: each is one seek of the index (MIN and MAX in one SELECT walk
            # every entry of the rank's group).
            lo, hi = con.execute(
                f"SELECT (SELECT MIN(step) FROM {self.table} WHERE {self.where}), "
                f"(SELECT MAX(step) FROM {self.table} WHERE {self.where})",
                self.params,
            ).fetchone()
            if lo is None:
                return
            span = max(1, hi - lo + 1)
            self.size = 1 << max(0, math.ceil(math.log2(max(1.0, span / self.width))))
        start = (max(self.buckets) * self.size) if self.buckets else -(1 << 62)
        # Per column: the sum of its numbers, how many cells it has, and how many hold the
        # text 'NaN' (how a NaN is stored): a bucket holding one has a NaN mean.
        aggs = ", ".join(
            f"TOTAL(CASE WHEN typeof({c}) != 'text' THEN {c} END), COUNT({c}), SUM(typeof({c}) = 'text')"
            for c in self.cols
        )
        sql = (
            f"SELECT step / {self.size} AS k, COUNT(*), MAX(step), {aggs} FROM {self.table} "
            f"WHERE {self.where} AND step >= ? GROUP BY k"
        )
        for row in con.execute(sql, (*self.params, start)):
            self.buckets[int(row[0])] = [float(x) if x is not None else 0.0 for x in row[1:]]
        while len(self.buckets) > self.width:
            self._merge()

    def _merge(self) -> None:
        merged: dict[int, list[float]] = {}
        for k in sorted(self.buckets):
            b = self.buckets[k]
            m = merged.get(k // 2)
            if m is None:
                merged[k // 2] = list(b)
            else:
                m[0] += b[0]
                m[1] = max(m[1], b[1])
                for i in range(2, len(b)):
                    m[i] += b[i]
        self.buckets = merged
        self.size *= 2

    def series(self, col: int = 0, scale: float = 1.0) -> Series:
        """The mean of ``cols[col]`` per bucket, times ``scale`` (None where nothing was measured)."""
        steps: list[float] = []
        values: list[float | None] = []
        for k in sorted(self.buckets):
            b = self.buckets[k]
            total, n, nans = b[2 + 3 * col], b[3 + 3 * col], b[4 + 3 * col]
            steps.append(int(b[1]))
            values.append(math.nan if nans else (total / n * scale if n else None))
        return Series(steps, values)


def step_buckets(rank_id: int, cols: Sequence[str], width: int) -> Buckets:
    """Columns of ``steps`` (e.g. ``step_ns``, the phases, memory) of one rank."""
    return Buckets("steps", cols, rank_is("?1"), (rank_id,), width)


def scalar_buckets(rank_id: int, name: str, width: int) -> Buckets:
    """The values of one logged scalar of one rank."""
    return Buckets("scalars", ("value",), f"{rank_is('?1')} AND name=?2", (rank_id, name), width)
