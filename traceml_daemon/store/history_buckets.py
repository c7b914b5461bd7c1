"""History's arithmetic: the per-level bucket stats steps add, merged exactly.

Each level of ``HISTORY_LEVELS`` (buckets of 64, 1024, 16384 steps) keeps, per
rank and per node, the count, min, max and sum of ``step_ns`` and of every
phase. Sums and counts (not means) are kept, so a bucket filled over several
writes, or across a daemon restart, merges exactly (in SQL too: ``history_sql``).
Everything here is pure and order-free (integer sums, min, max): how steps are
split into folds never changes what is stored. A sum that would leave the
int64 range is pinned at its bound (``traceml_wire.bounds.saturate``), as the
SQL merge does: SQLite stores nothing wider, and a saturated figure says
"beyond measure" whichever fold got there first.

Agents may send the finest buckets of their own steps (``traceml_wire/partials.py``,
computed by the same code): ``merge_fine`` and ``add_fine_deltas`` take those, and
only rows that came without are folded from columns (``add_rank_deltas``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from traceml_daemon.analysis.stats import max_or_none, min_or_none
from traceml_daemon.store.schema import HISTORY_LEVELS
from traceml_wire import partials as wire_history
from traceml_wire.bounds import saturate

# Stats is a flat list, for speed on the ingest path (``traceml_wire.partials``):
# [n, first_step, last_step, last_ts, then per metric: count, min, max, sum]
Stats = wire_history.Stats
BASE = wire_history.BASE
WIDTH = wire_history.WIDTH

# A rank's history columns: ``HISTORY_COLUMNS`` order, each a sequence over its steps.
HISTORY_COLUMNS = wire_history.COLUMNS
Columns = wire_history.Columns

NodeKey = tuple[str, int, int]  # session, attempt, node_rank


def _lo(a: Any, b: Any) -> Any:
    return b if a is None else a if b is None or a <= b else b


def _hi(a: Any, b: Any) -> Any:
    return b if a is None else a if b is None or a >= b else b


def merge_into(acc: Stats, other: Stats) -> None:
    """Fold ``other`` into ``acc`` (same bucket)."""
    acc[0] += other[0]
    acc[1] = _lo(acc[1], other[1])
    acc[2] = _hi(acc[2], other[2])
    acc[3] = _hi(acc[3], other[3])
    for i in range(BASE, WIDTH, 4):
        if other[i]:
            acc[i] += other[i]
            acc[i + 1] = _lo(acc[i + 1], other[i + 1])
            acc[i + 2] = _hi(acc[i + 2], other[i + 2])
            acc[i + 3] = saturate(acc[i + 3] + other[i + 3])


def merged(group: Sequence[Stats]) -> Stats:
    """``group`` merged into one new Stats (as ``merge_into`` one by one, order-free):
    one C-level pass per figure over the group instead of a Python loop per member."""
    if len(group) == 1:
        return list(group[0])
    figures = list(zip(*group, strict=True))
    out: Stats = [sum(figures[0]), min_or_none(figures[1]), max_or_none(figures[2]), max_or_none(figures[3])]
    for i in range(BASE, WIDTH, 4):
        # A metric no member measured has count 0, min and max None and sum 0.
        out += [
            sum(figures[i]), min_or_none(figures[i + 1]), max_or_none(figures[i + 2]), saturate(sum(figures[i + 3]))
        ]
    return out


def add_rank_deltas(rank_id: int, cols: Columns, out: dict[tuple[int, int, int], Stats]) -> None:
    """Add what one rank's columns (``HISTORY_COLUMNS`` order) add to every level to ``out``."""
    add_fine_deltas(rank_id, wire_history.fine_stats(cols), out)


def merge_fine(parts: Iterable[list[tuple[int, Stats]]]) -> list[tuple[int, Stats]]:
    """Several sets of (bucket, Stats) of the finest level (partials sent with batches,
    stats of rows folded here) as one, a bucket at most once, ascending; the inputs
    are not changed."""
    by: dict[int, Stats] = {}
    for part in parts:
        for bucket, stats in part:
            have = by.get(bucket)
            if have is None:
                by[bucket] = list(stats)
            else:  # a bucket split between two flushes
                merge_into(have, stats)
    return sorted(by.items())


def add_fine_deltas(rank_id: int, fine_stats: list[tuple[int, Stats]], out: dict[tuple[int, int, int], Stats]) -> None:
    """Add one rank's finest buckets (each at most once) and what they add to every
    coarser level to ``out``.

    A coarser level whose bucket holds all of them (the usual case: a write carries a
    few seconds of steps per rank) takes their stats merged once; otherwise each of its
    buckets merges the finest buckets it holds (the levels nest)."""
    if not fine_stats:
        return
    fine, coarse = HISTORY_LEVELS[0], HISTORY_LEVELS[1:]
    for bucket, stats in fine_stats:
        out[(rank_id, fine, bucket)] = stats
    if len(fine_stats) == 1:
        whole: Stats | None = fine_stats[0][1]
        lo = hi = fine_stats[0][0] * fine
    else:
        whole = None
        buckets = [bucket for bucket, _ in fine_stats]
        lo, hi = min(buckets) * fine, max(buckets) * fine
    for level in coarse:
        if lo // level == hi // level:
            if whole is None:
                # Merging the fine buckets' stats costs a few operations per bucket,
                # where another pass over every column costs several per row.
                whole = merged([stats for _, stats in fine_stats])
            out[(rank_id, level, lo // level)] = list(whole)
            continue
        groups: dict[int, list[Stats]] = {}
        for bucket, stats in fine_stats:
            groups.setdefault(bucket * fine // level, []).append(stats)
        for bucket, group in groups.items():
            out[(rank_id, level, bucket)] = merged(group)


def history_columns(cols: dict[str, Sequence[Any]]) -> Columns:
    """A rank's steps as named columns -> ``HISTORY_COLUMNS`` order."""
    return [cols[name] for name in HISTORY_COLUMNS]


def bucket_deltas(steps_by_rank: dict[int, dict[str, Sequence[Any]]]) -> dict[tuple[int, int, int], Stats]:
    """What these steps add to every (rank_id, level, bucket): ``add_rank_deltas`` per rank."""
    out: dict[tuple[int, int, int], Stats] = {}
    for rank_id, cols in steps_by_rank.items():
        add_rank_deltas(rank_id, history_columns(cols), out)
    return out


def node_deltas(
    deltas: dict[tuple[int, int, int], Stats], node_of: Callable[[int], NodeKey | None]
) -> dict[tuple[str, int, int, int, int], Stats]:
    """Rank deltas merged per (node, level, bucket): grouped first, then each group
    merged in one columnar pass (``merged``)."""
    groups: dict[tuple[str, int, int, int, int], list[Stats]] = {}
    last_rank: int | None = None
    node: NodeKey | None = None
    for (rank_id, level, bucket), stats in deltas.items():
        if rank_id != last_rank:  # a rank's deltas are adjacent: one lookup per rank
            last_rank, node = rank_id, node_of(rank_id)
        if node is None:
            continue
        key = (*node, level, bucket)
        group = groups.get(key)
        if group is None:
            groups[key] = [stats]
        else:
            group.append(stats)
    return {key: merged(group) for key, group in groups.items()}
