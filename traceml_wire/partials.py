"""History partials: what a batch's steps add to the finest history buckets (pure; no I/O).

The daemon keeps downsampled history per rank and per node: for every bucket
of ``FINE_STEPS`` steps the count, min, max and sum of the step time and of
every phase, and coarser levels merged from those buckets. Folding raw steps
into buckets in the daemon was its largest share of the GIL after SQLite
itself. The rows are produced on many hosts; the fold is exact and
order-free. So an agent computes its batch's fine buckets on its sender thread
(``encode_partials``) and sends them beside its steps (the body's
``"history"`` field); the daemon checks them against the batch
(``decode_partials``) and merges a row per bucket instead of folding every
step. Steps that come without partials (small batches, older agents, a
daemon catching up after a crash) are folded by the daemon with the same code
(``fine_stats``), so the stored history is the same either way.

Stats (one bucket, a flat list for speed):
``[n, first_step, last_step, last_ts, then per metric: count, min, max, sum]``
where a metric is ``step`` or a phase, read from its ``{metric}_ns`` column;
``None`` cells ("not measured") stay out of that metric's figures. A sum
saturates at the int64 bounds (``traceml_wire.bounds.saturate``): SQLite
stores nothing wider, and a bucket of long steps must still be storable.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from itertools import chain, repeat
from typing import Any

from traceml_wire.bounds import MAX_DURATION_NS, is_int64, saturate
from traceml_wire.errors import ProtocolError
from traceml_wire.tables import PHASES

FINE_STEPS = 64  # steps per bucket of the finest history level
# A batch with fewer steps carries no partials: its one or two bucket rows (33
# cells each) would cost the daemon about as much to decode and check as its
# steps cost to fold.
PARTIALS_MIN_STEPS = 64

METRICS = ("step", *PHASES)
METRIC_COLUMNS = tuple(f"{m}_ns" for m in METRICS)
# A rank's steps as history reads them, each a sequence over the steps.
COLUMNS = ("step", "ts", *METRIC_COLUMNS)
STAT_FIELDS = ("n", "first_step", "last_step", "last_ts") + tuple(
    f"{m}_{k}" for m in METRICS for k in ("n", "min", "max", "sum")
)
# The wire form: one row per bucket, columnar, "bucket" then every stat.
PARTIAL_COLUMNS = ("bucket", *STAT_FIELDS)
BASE = 4  # stats before the first metric's
WIDTH = BASE + 4 * len(METRICS)

Stats = list[Any]
Columns = Sequence[Sequence[Any]]
_chain = chain.from_iterable


def _max_or_none(values: Sequence[Any]) -> Any:
    try:
        return max(values)
    except TypeError:  # a None among numbers
        return max((v for v in values if v is not None), default=None)


def stats_of(cols: Columns, ordered: bool = False) -> Stats:
    """Stats of whole columns (``COLUMNS`` order, steps all set, at least one row;
    ``ordered``: the steps ascend, so their first and last are their min and max).

    Every figure is a C-level pass over a column: with no None in any metric (the
    usual case) one ``map`` per figure covers every metric at once."""
    steps, ts, *metrics = cols
    n = len(steps)
    if ordered:  # two passes of the ~24 a bucket costs
        head: Stats = [n, steps[0], steps[-1], _max_or_none(ts)]
    else:
        head = [n, min(steps), max(steps), _max_or_none(ts)]
    try:
        # sum() fails on any None ("not measured", which stays out of every figure):
        # trying first saves a scan for None on every column of every bucket.
        sums = list(map(saturate, map(sum, metrics)))
    except TypeError:
        return head + _metric_stats(metrics)
    return head + list(_chain(zip(repeat(n), map(min, metrics), map(max, metrics), sums)))


def _metric_stats(metrics: Columns) -> Stats:
    out: Stats = []
    for values in metrics:
        try:
            total = sum(values)
        except TypeError:
            values = [v for v in values if v is not None]
            total = sum(values)
        if values:
            out += [len(values), min(values), max(values), saturate(total)]
        else:
            out += [0, None, None, 0]
    return out


def _fine_groups(steps: Sequence[int], size: int) -> tuple[bool, list[tuple[int, slice | list[int] | None]]]:
    """Whether the steps ascend, and (bucket, rows) per bucket: None for all rows,
    slices when steps arrive in order (the usual case), index lists otherwise."""
    first, last = steps[0], steps[-1]
    if sorted(steps) == list(steps):  # C-level; linear on sorted input (steps may be a tuple)
        if first // size == last // size:
            return True, [(first // size, None)]
        # One bisect per bucket instead of a division per row.
        out: list[tuple[int, slice | list[int] | None]] = []
        start, n = 0, len(steps)
        while start < n:
            bucket = steps[start] // size
            end = bisect_left(steps, (bucket + 1) * size, start)
            out.append((bucket, slice(start, end)))
            start = end
        return True, out
    by: dict[int, list[int]] = {}
    for i, s in enumerate(steps):
        by.setdefault(s // size, []).append(i)
    return False, list(by.items())


def _pick(cols: Columns, idx: slice | list[int] | None) -> Columns:
    if idx is None:
        return cols
    if isinstance(idx, slice):
        return [c[idx] for c in cols]
    return [[c[i] for i in idx] for c in cols]


def fine_stats(cols: Columns) -> list[tuple[int, Stats]]:
    """(bucket, Stats) of every fine bucket these steps (``COLUMNS`` order) touch,
    ascending when the steps do; steps whose number is None are left out."""
    steps = cols[0]
    if None in steps:
        keep = [i for i, s in enumerate(steps) if s is not None]
        cols = [[v[i] for i in keep] for v in cols]
        steps = cols[0]
    if not steps:
        return []
    ordered, rows_by_bucket = _fine_groups(steps, FINE_STEPS)
    return [(bucket, stats_of(_pick(cols, idx), ordered)) for bucket, idx in rows_by_bucket]


# ------------------------------------------------------------------ agent side


def encode_partials(steps: dict[str, Sequence[Any]]) -> dict[str, Any] | None:
    """The ``"history"`` field of a body whose steps table is ``steps`` (column name to
    list), or None: too few steps to be worth it, or columns history cannot read
    (the daemon then folds the rows itself). Never raises."""
    try:
        if len(steps.get("step") or ()) < PARTIALS_MIN_STEPS:
            return None
        cols = [steps[name] for name in COLUMNS]
        if len(set(map(len, cols))) != 1:
            return None
        buckets = fine_stats(cols)
    except Exception:  # a column missing or of odd values: the rows still go, unfolded
        return None
    if not buckets:
        return None
    rows = [(bucket, *stats) for bucket, stats in buckets]
    return {"level": FINE_STEPS, "cols": dict(zip(PARTIAL_COLUMNS, map(list, zip(*rows, strict=True)), strict=True))}


# ------------------------------------------------------------------ daemon side


def _is_duration(value: Any) -> bool:
    # What the daemon stores of a step or phase cell (longer ones become NULL).
    return type(value) is int and -MAX_DURATION_NS <= value <= MAX_DURATION_NS


def _check_metric(n: int, count: Any, lo: Any, hi: Any, total: Any) -> str | None:
    if type(count) is not int or not 0 <= count <= n:
        return "a metric count outside 0..n"
    if count == 0:
        return None if lo is None and hi is None and total == 0 else "figures for a metric counted 0 times"
    if not (_is_duration(lo) and _is_duration(hi) and is_int64(total)):
        return "a metric figure that is not a 64-bit integer, or a duration beyond the stored maximum"
    if not (lo <= hi and lo * count <= total <= hi * count):
        return "a metric whose min, max and sum disagree"
    return None


def _check_row(row: tuple[Any, ...]) -> str | None:
    bucket, n, first, last, last_ts = row[:5]
    if type(n) is not int or n < 1:
        return "a bucket of no steps"
    if not (is_int64(bucket) and is_int64(first) and is_int64(last)):
        return "a bucket or step that is not a 64-bit integer"
    if not (first <= last and first // FINE_STEPS == bucket == last // FINE_STEPS):
        return "steps outside their bucket"
    if last_ts is not None and type(last_ts) not in (float, int):
        return "a last_ts that is not a number"
    for at in range(1 + BASE, 1 + WIDTH, 4):
        problem = _check_metric(n, *row[at : at + 4])
        if problem:
            return problem
    return None


def decode_partials(raw: Any, steps: Sequence[Any]) -> list[tuple[int, Stats]]:
    """A body's ``"history"`` field, checked against the ``steps`` column of the same
    body, as (bucket, Stats) rows; ProtocolError names the first problem (the daemon
    then folds the batch's rows itself and loses nothing).

    The checks make a partial merge safely with any other (types, int64 range, minima
    and maxima within the stored duration bound, every step in its bucket, counts
    within n, min <= sum / count <= max) and account for exactly the batch's steps
    (their count); they do not recompute the figures."""
    if type(raw) is not dict or raw.get("level") != FINE_STEPS:
        raise ProtocolError(f"history partials must be a map with level {FINE_STEPS}")
    cols = raw.get("cols")
    if type(cols) is not dict:
        raise ProtocolError("history partials need a 'cols' map")
    values = [cols.get(name) for name in PARTIAL_COLUMNS]
    if not all(type(v) in (tuple, list) for v in values):
        missing = next(name for name, v in zip(PARTIAL_COLUMNS, values, strict=True) if type(v) not in (tuple, list))
        raise ProtocolError(f"history partials lack a list for column {missing!r}")
    if len(set(map(len, values))) != 1:
        raise ProtocolError("history partials have columns of different lengths")
    rows = list(zip(*values, strict=True))
    buckets = [row[0] for row in rows]
    if len(set(buckets)) != len(buckets):
        raise ProtocolError("history partials repeat a bucket")
    for row in rows:
        problem = _check_row(row)
        if problem:
            raise ProtocolError(f"history partials hold {problem}")
    counted = sum(row[1] for row in rows)
    if counted != len(steps) - steps.count(None):
        raise ProtocolError(f"history partials count {counted} steps, the batch has {len(steps) - steps.count(None)}")
    return [(row[0], list(row[1:])) for row in rows]
