"""Downsampled step history: maintained as steps arrive, read for overviews.

Raw steps grow with the run (1M steps x 64 ranks = 64M rows) and may be
deleted by retention, so views of a whole run never read them. Instead the
writer folds every committed step into:

* ``rank_history`` / ``node_history``: per rank and per node, for each level
  in ``HISTORY_LEVELS`` (buckets of 64, 1024, 16384 steps), the count, min,
  max and sum of ``step_ns`` and of every phase. Sums and counts (not means)
  are stored so a bucket filled over several transactions, or across a daemon
  restart, merges exactly in SQL.
* ``reservoir``: per rank a uniform sample (Algorithm L) of up to
  ``RESERVOIR_SIZE`` raw points (fewer per rank in big jobs, so the table stays
  bounded: ``IngestPolicy.reservoir_size_for``), plus slot ``LATEST_SLOT`` that always holds
  the newest point, so medians of a whole run and "where is it now" cost a
  few hundred rows per rank.

Writing side (pure, used by ``StoreWriter`` and by ``bench/history.py``):

    deltas = bucket_deltas(steps_by_rank)            # {(rank_id, level, bucket): Stats}
    nodes = node_deltas(deltas, node_of)             # {(session, attempt, node, level, bucket): Stats}
    sampler.offer(rank_id, cols, plan)               # reservoir rows to upsert
    conn.executemany(RANK_UPSERT, rank_rows(deltas)) # merge in SQL

The writer calls the column-list forms (``add_rank_deltas``, ``offer_columns``:
columns in ``HISTORY_COLUMNS`` order) one rank at a time; for batches whose agent
sent history partials (``traceml_wire/partials.py``: the finest buckets of its own
steps, computed by the same code) it merges those instead (``merge_fine``,
``add_fine_deltas``) and folds only the rows that came without. Everything is exact and
order-free (integer sums, min, max), so how steps are split into folds never
changes what is stored. The reservoir's sample is uniform however they are
split, and a pure function of the split: each offer that draws takes a stream
seeded from the rank and the saved state (``seeded_stream``), so a retried
transaction or a restarted daemon draws deterministically.

Reading side: ``overview(conn, run, width)`` and the ``*_series`` functions.
"""

from __future__ import annotations

import math
import random
import sqlite3
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain, repeat
from operator import itemgetter
from typing import Any

from traceml_daemon.analysis.nodes import by_node_with_worst
from traceml_daemon.analysis.stats import max_or_none, min_or_none
from traceml_daemon.store.schema import HISTORY_LEVELS, HISTORY_METRICS, LATEST_SLOT, RESERVOIR_SIZE
from traceml_wire import partials as wire_history
from traceml_wire.tables import PHASES

# Stats is a flat list, for speed on the ingest path (``traceml_wire.partials``):
# [n, first_step, last_step, last_ts, then per metric: count, min, max, sum]
Stats = wire_history.Stats
_BASE = wire_history.BASE
_WIDTH = wire_history.WIDTH
_chain = chain.from_iterable


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
    for i in range(_BASE, _WIDTH, 4):
        if other[i]:
            acc[i] += other[i]
            acc[i + 1] = _lo(acc[i + 1], other[i + 1])
            acc[i + 2] = _hi(acc[i + 2], other[i + 2])
            acc[i + 3] += other[i + 3]


# A rank's history columns: ``HISTORY_COLUMNS`` order, each a sequence over its steps.
HISTORY_COLUMNS = wire_history.COLUMNS
Columns = wire_history.Columns
# Reservoir.offer_columns builds a drawn point's row from the columns by position.
assert len(HISTORY_COLUMNS) == 9, "Reservoir.offer_columns unpacks exactly the history columns"


def _merged(group: Sequence[Stats]) -> Stats:
    """``group`` merged into one new Stats (as ``merge_into`` one by one, order-free):
    one C-level pass per figure over the group instead of a Python loop per member."""
    if len(group) == 1:
        return list(group[0])
    figures = list(zip(*group, strict=True))
    out: Stats = [sum(figures[0]), min_or_none(figures[1]), max_or_none(figures[2]), max_or_none(figures[3])]
    for i in range(_BASE, _WIDTH, 4):
        # A metric no member measured has count 0, min and max None and sum 0.
        out += [sum(figures[i]), min_or_none(figures[i + 1]), max_or_none(figures[i + 2]), sum(figures[i + 3])]
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
                # Merging the fine buckets' stats costs a few operations per bucket;
                # another min/max/sum pass over every column cost several per row.
                whole = _merged([stats for _, stats in fine_stats])
            out[(rank_id, level, lo // level)] = list(whole)
            continue
        groups: dict[int, list[Stats]] = {}
        for bucket, stats in fine_stats:
            groups.setdefault(bucket * fine // level, []).append(stats)
        for bucket, group in groups.items():
            out[(rank_id, level, bucket)] = _merged(group)


def history_columns(cols: dict[str, Sequence[Any]]) -> Columns:
    """A rank's steps as named columns -> ``HISTORY_COLUMNS`` order."""
    return [cols[name] for name in HISTORY_COLUMNS]


def bucket_deltas(steps_by_rank: dict[int, dict[str, Sequence[Any]]]) -> dict[tuple[int, int, int], Stats]:
    """What these steps add to every (rank_id, level, bucket): ``add_rank_deltas`` per rank."""
    out: dict[tuple[int, int, int], Stats] = {}
    for rank_id, cols in steps_by_rank.items():
        add_rank_deltas(rank_id, history_columns(cols), out)
    return out


NodeKey = tuple[str, int, int]  # session, attempt, node_rank


def node_deltas(
    deltas: dict[tuple[int, int, int], Stats], node_of: Callable[[int], NodeKey | None]
) -> dict[tuple[str, int, int, int, int], Stats]:
    """Rank deltas merged per (node, level, bucket): grouped first, then each group
    merged in one columnar pass (``_merged``)."""
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
    return {key: _merged(group) for key, group in groups.items()}


# ------------------------------------------------------------------ SQL (write)

_STAT_COLS = ("n", "first_step", "last_step", "last_ts") + tuple(
    f"{m}_{k}" for m in HISTORY_METRICS for k in ("n", "min", "max", "sum")
)


def _merge_sql(col: str) -> str:
    # NULL means "no value yet"; SQL's multi-argument min/max would return NULL.
    if col.endswith("_min") or col == "first_step":
        return f"{col}=min(coalesce({col}, excluded.{col}), coalesce(excluded.{col}, {col}))"
    if col.endswith("_max") or col in ("last_step", "last_ts"):
        return f"{col}=max(coalesce({col}, excluded.{col}), coalesce(excluded.{col}, {col}))"
    return f"{col}={col}+excluded.{col}"


# (head, tail, width) of each statement, so the writer can put many rows in one
# ``head VALUES (...), (...) tail`` statement: one sqlite3_step, one GIL hand-off.
SqlParts = tuple[str, str, int]


def _upsert_parts(table: str, keys: tuple[str, ...]) -> SqlParts:
    cols = keys + _STAT_COLS
    return (
        f"INSERT INTO {table} ({', '.join(cols)})",
        f"ON CONFLICT({', '.join(keys)}) DO UPDATE SET {', '.join(_merge_sql(c) for c in _STAT_COLS)}",
        len(cols),
    )


def _one_row(parts: SqlParts) -> str:
    head, tail, width = parts
    return f"{head} VALUES ({', '.join('?' * width)}) {tail}".rstrip()


RANK_UPSERT_PARTS = _upsert_parts("rank_history", ("rank_id", "level", "bucket"))
NODE_UPSERT_PARTS = _upsert_parts("node_history", ("session", "attempt", "node_rank", "level", "bucket"))
_RES_COLS = ("rank_id", "slot", "step", "ts", "step_ns", *(f"{p}_ns" for p in PHASES))
RESERVOIR_UPSERT_PARTS: SqlParts = (f"INSERT OR REPLACE INTO reservoir ({', '.join(_RES_COLS)})", "", len(_RES_COLS))
RESERVOIR_STATE_UPSERT_PARTS: SqlParts = (
    "INSERT OR REPLACE INTO reservoir_state (rank_id, seen, next_take, w, size)", "", 5
)
RANK_UPSERT = _one_row(RANK_UPSERT_PARTS)
NODE_UPSERT = _one_row(NODE_UPSERT_PARTS)
RESERVOIR_UPSERT = _one_row(RESERVOIR_UPSERT_PARTS)
RESERVOIR_STATE_UPSERT = _one_row(RESERVOIR_STATE_UPSERT_PARTS)


def history_rows(deltas: dict[Any, Stats]) -> list[tuple[Any, ...]]:
    return [(*key, *stats) for key, stats in deltas.items()]


# ------------------------------------------------------------------ reservoir

_LAST = itemgetter(-1)
# Bits drawn for the replaced slot: ``% k`` of them is uniform within k / 2**22.
_SLOT_BITS = 22


def seeded_stream(rank_id: int, next_take: int) -> random.Random:
    """The draws of one offer, seeded from the rank and its saved state.

    Algorithm L consumes it in order (``Reservoir._draws``), one draw per point
    that enters. A retried transaction (the state rolled back) and a restarted
    daemon (the state reloaded) seed the same stream and draw the same sample.
    Mersenne Twister's C methods cost ~40 ns a number, against ~800 ns for the
    two rounds of splitmix64 over Python's 64-bit ints that a draw used to take,
    as a pure function of its position; seeding costs ~5 us, once per offer that
    draws (one per rank and history write at most). A stream kept per rank would
    save the seeding but hold 2.5 KB per rank (10 MB at 4096 ranks).
    """
    return random.Random((rank_id << 64) | next_take)


@dataclass
class ReservoirState:
    """Algorithm L: after the first k points, skip ahead to the next point
    that enters the sample instead of drawing a random number per point."""

    seen: int = 0
    next_take: int = 0  # index (0-based, over all points seen) of the next point to enter
    w: float = 0.0
    size: int = RESERVOIR_SIZE  # points in this rank's sample, fixed when it starts


@dataclass
class ReservoirUpdate:
    rows: dict[tuple[int, int], tuple[Any, ...]] = field(default_factory=dict)  # (rank_id, slot) -> row
    states: dict[int, ReservoirState] = field(default_factory=dict)
    before: dict[int, ReservoirState] = field(default_factory=dict)  # for rollback


class Reservoir:
    """Per-rank uniform samples of raw step points; state lives here, rows in SQL."""

    def __init__(self, size: int = RESERVOIR_SIZE) -> None:
        self.size = size  # the sample size of a rank offered none
        self.states: dict[int, ReservoirState] = {}

    def load(self, rows: Iterable[tuple[int, int, int, float, int]]) -> None:
        for rank_id, seen, next_take, w, size in rows:
            self.states[rank_id] = ReservoirState(seen, next_take, w, size)

    @staticmethod
    def _draws(stream: random.Random) -> tuple[float, float, int]:
        """(u1, u2, h): two uniforms in (0, 1] and the slot's bits, taken from the
        stream in the order ``offer_columns`` (which inlines this) takes them: h first."""
        h = stream.getrandbits(_SLOT_BITS)
        return 1.0 - stream.random(), 1.0 - stream.random(), h

    @staticmethod
    def _gap(w: float, u: float) -> int:
        """How many points until the next one enters (>= 1)."""
        if w >= 1.0:
            return 1
        return int(math.log(u) / math.log1p(-w)) + 1

    def offer(self, rank_id: int, cols: dict[str, Sequence[Any]], update: ReservoirUpdate) -> None:
        self.offer_columns(rank_id, history_columns(cols), update)

    def offer_columns(self, rank_id: int, columns: Columns, update: ReservoirUpdate, size: int | None = None) -> None:
        """Offer one rank's new points (``HISTORY_COLUMNS`` order) to its sample.

        ``size``: the sample size of a rank offered its first points (default
        ``self.size``); a rank keeps the size it started with."""
        steps = columns[0]
        n = len(steps)
        if n == 0:
            return
        state = self.states.get(rank_id)
        if state is None:
            state = self.states[rank_id] = ReservoirState(size=size or self.size)
        k = state.size
        if rank_id not in update.before:
            update.before[rank_id] = ReservoirState(state.seen, state.next_take, state.w, k)
        rows = update.rows
        start = state.seen
        end = start + n
        fill = max(0, min(n, k - start))
        if fill:  # filling: every point enters, keys and rows built column-wise in C
            slots = range(start, start + fill)
            keys = zip(repeat(rank_id, fill), slots, strict=True)
            values = zip(repeat(rank_id, fill), slots, *(c[:fill] for c in columns), strict=True)
            rows.update(zip(keys, values, strict=True))
        if end > k and (state.w == 0.0 or state.next_take < end):  # a point of this offer enters
            stream = seeded_stream(rank_id, state.next_take)
            if state.w == 0.0:  # the sample just filled (or was backfilled by a migration)
                begin = max(start, k)
                u1, u2, _ = self._draws(stream)
                state.w = u1 ** (1.0 / k)
                state.next_take = begin - 1 + self._gap(state.w, u2)
            w, take = state.w, state.next_take
            # Algorithm L: only the points that enter are touched, ~k*ln(seen) of them in all.
            # ``_draws`` and ``_gap`` inlined (the same draws in the same order, so the same
            # sample): early in a run at 1024 ranks this loop runs ~70,000 times a second.
            # It only notes which point each drawn slot takes: early in a run one offer
            # replaces the same slot several times, and a row is built once per slot below.
            uniform, bits, log, log1p = stream.random, stream.getrandbits, math.log, math.log1p
            inv_k = 1.0 / k
            picked: dict[int, int] = {}  # slot -> the position that took it last
            while take < end:
                picked[bits(_SLOT_BITS) % k] = take
                w *= (1.0 - uniform()) ** inv_k
                u2 = 1.0 - uniform()  # taken whatever w is: every draw takes three numbers
                take += 1 if w >= 1.0 else int(log(u2) / log1p(-w)) + 1
            # The rows from the columns held in locals: 170 ns a row against 390 through
            # ``map(itemgetter(i), columns)`` (an itemgetter, a map and an unpacking a row).
            c0, c1, c2, c3, c4, c5, c6, c7, c8 = columns  # HISTORY_COLUMNS (their count is asserted at import)
            for slot, position in picked.items():
                i = position - start
                rows[(rank_id, slot)] = (rank_id, slot, c0[i], c1[i], c2[i], c3[i], c4[i], c5[i], c6[i], c7[i], c8[i])
            state.w, state.next_take = w, take
        state.seen = end
        rows[(rank_id, LATEST_SLOT)] = (rank_id, LATEST_SLOT, *map(_LAST, columns))
        update.states[rank_id] = state

    def rollback(self, update: ReservoirUpdate) -> None:
        self.states.update(update.before)


def reservoir_rows(update: ReservoirUpdate) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    rows = list(update.rows.values())
    states = [(rid, s.seen, s.next_take, s.w, s.size) for rid, s in update.states.items()]
    return rows, states


# ------------------------------------------------------------------ reading


@dataclass
class Point:
    """One bucket (or several merged) of a series."""

    first_step: int | None
    last_step: int | None
    last_ts: float | None
    n: int
    min_ms: dict[str, float | None]
    mean_ms: dict[str, float | None]
    max_ms: dict[str, float | None]


def _point(stats: Stats) -> Point:
    mins: dict[str, float | None] = {}
    means: dict[str, float | None] = {}
    maxs: dict[str, float | None] = {}
    for j, m in enumerate(HISTORY_METRICS):
        cnt, lo, hi, total = stats[_BASE + 4 * j : _BASE + 4 * j + 4]
        mins[m] = lo / 1e6 if cnt else None
        maxs[m] = hi / 1e6 if cnt else None
        means[m] = total / cnt / 1e6 if cnt else None
    return Point(stats[1], stats[2], stats[3], stats[0], mins, means, maxs)


def choose_level(first_step: int, last_step: int, width: int) -> tuple[int, int]:
    """(level, buckets merged per point): the finest level whose bucket count fits ``width``."""
    span = last_step - first_step + 1
    for level in HISTORY_LEVELS:
        if math.ceil(span / level) + 1 <= width:
            return level, 1
    level = HISTORY_LEVELS[-1]
    return level, math.ceil((span // level + 2) / max(1, width))


def _series(rows: Iterable[tuple[Any, ...]], nkeys: int, group: int) -> dict[Any, list[Point]]:
    """rows: (*key, bucket, *stats) ordered by key then bucket -> key -> points."""
    acc: dict[Any, dict[int, Stats]] = {}
    for row in rows:
        key = row[0] if nkeys == 1 else tuple(row[:nkeys])
        slot = row[nkeys] // group
        stats = list(row[nkeys + 1 :])
        per = acc.setdefault(key, {})
        have = per.get(slot)
        if have is None:
            per[slot] = stats
        else:
            merge_into(have, stats)
    return {k: [_point(per[s]) for s in sorted(per)] for k, per in acc.items()}


_STAT_SELECT = ", ".join(_STAT_COLS)


@dataclass
class RunSpan:
    first_step: int | None
    last_step: int | None
    steps: int  # step rows folded into history (all ranks)
    first_ts: float | None
    last_ts: float | None


def run_span(conn: sqlite3.Connection, session: str, attempt: int) -> RunSpan:
    """From the coarsest node level: a few rows per node, whatever the run length."""
    row = conn.execute(
        "SELECT min(first_step), max(last_step), sum(n), max(last_ts) FROM node_history "
        "WHERE session=? AND attempt=? AND level=?",
        (session, attempt, HISTORY_LEVELS[-1]),
    ).fetchone()
    first_ts = conn.execute(
        "SELECT min(ts) FROM reservoir JOIN ranks USING (rank_id) WHERE session=? AND attempt=? AND slot>=0",
        (session, attempt),
    ).fetchone()[0]
    return RunSpan(row[0], row[1], int(row[2] or 0), first_ts, row[3])


def rank_series(
    conn: sqlite3.Connection, session: str, attempt: int, width: int = 200, span: RunSpan | None = None
) -> dict[int, list[Point]]:
    """global_rank (or -rank_id when unknown) -> at most ~``width`` points over the whole run."""
    return _keyed_series(
        conn, session, attempt, width, span,
        f"SELECT coalesce(r.global_rank, -r.rank_id), h.bucket, {_STAT_SELECT} FROM rank_history h "
        "JOIN ranks r USING (rank_id) WHERE r.session=? AND r.attempt=? AND h.level=? ORDER BY 1, h.bucket",
    )


def node_series(
    conn: sqlite3.Connection, session: str, attempt: int, width: int = 200, span: RunSpan | None = None
) -> dict[int, list[Point]]:
    """node_rank -> at most ~``width`` points (min/mean/max over the node's ranks)."""
    return _keyed_series(
        conn, session, attempt, width, span,
        f"SELECT node_rank, bucket, {_STAT_SELECT} FROM node_history WHERE session=? AND attempt=? AND level=? "
        "ORDER BY node_rank, bucket",
    )


def _keyed_series(
    conn: sqlite3.Connection, session: str, attempt: int, width: int, span: RunSpan | None, sql: str
) -> dict[int, list[Point]]:
    """Run a (key, bucket, stats...) query at the level that gives ~``width`` points."""
    span = span or run_span(conn, session, attempt)
    if span.first_step is None or span.last_step is None:
        return {}
    level, group = choose_level(span.first_step, span.last_step, width)
    return _series(conn.execute(sql, (session, attempt, level)), 1, group)


def run_series(conn: sqlite3.Connection, session: str, attempt: int, width: int = 200,
               span: RunSpan | None = None) -> list[Point]:
    """The whole run's step-time series: every node's buckets merged per bucket."""
    span = span or run_span(conn, session, attempt)
    if span.first_step is None or span.last_step is None:
        return []
    level, group = choose_level(span.first_step, span.last_step, width)
    rows = conn.execute(
        f"SELECT 0, bucket, {_STAT_SELECT} FROM node_history WHERE session=? AND attempt=? AND level=? "
        "ORDER BY bucket",
        (session, attempt, level),
    )
    return _series(rows, 1, group).get(0, [])


@dataclass
class RankOverview:
    rank_id: int
    global_rank: int | None
    node_rank: int | None
    hostname: str | None
    last_step: int | None  # from the reservoir's latest point
    step_ms_median: float | None  # over the whole run, from the reservoir sample
    phases_ms_median: dict[str, float | None]
    busy_ms_median: float | None = None  # step minus wait under DDP (wait measured), else step


@dataclass
class NodeOverview:
    node_rank: int
    hostname: str | None
    ranks: list[int]
    step_ms_median: float | None  # median of its ranks' medians
    worst_rank: int | None


@dataclass
class Overview:
    session: str
    attempt: int
    span: RunSpan
    ranks: list[RankOverview]
    nodes: list[NodeOverview]
    series: list[Point]  # whole-run step time, <= ~width points
    node_series: dict[int, list[Point]]
    level: int  # bucket size the series were read at


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def rank_medians(conn: sqlite3.Connection, session: str, attempt: int) -> list[RankOverview]:
    """Whole-run medians per rank from the reservoir sample (<= RESERVOIR_SIZE + 1 rows per rank)."""
    cols = ", ".join(f"s.{c}" for c in _RES_COLS[2:])
    ranks = conn.execute(
        "SELECT rank_id, global_rank, node_rank, hostname, parallelism FROM ranks WHERE session=? AND attempt=? "
        "ORDER BY global_rank, rank_id",
        (session, attempt),
    ).fetchall()
    samples: dict[int, list[tuple[Any, ...]]] = {}
    latest: dict[int, int | None] = {}
    for row in conn.execute(
        f"SELECT s.rank_id, s.slot, {cols} FROM reservoir s JOIN ranks r USING (rank_id) "
        "WHERE r.session=? AND r.attempt=?",
        (session, attempt),
    ):
        if row[1] == LATEST_SLOT:
            latest[row[0]] = row[2]
        else:
            samples.setdefault(row[0], []).append(row[4:])
    out = []
    wait_at = HISTORY_METRICS.index("wait")
    for rank_id, global_rank, node_rank, hostname, parallelism in ranks:
        pts = samples.get(rank_id, [])
        med = {
            m: _median([p[j] / 1e6 for p in pts if p[j] is not None]) for j, m in enumerate(HISTORY_METRICS)
        }
        # As in analysis/window.py: only DDP measures wait as time blocked on peers.
        busy = (
            _median([(p[0] - (p[wait_at] or 0)) / 1e6 for p in pts if p[0] is not None])
            if parallelism == "ddp"
            else med["step"]
        )
        out.append(
            RankOverview(
                rank_id, global_rank, node_rank, hostname, latest.get(rank_id), med["step"],
                {p: med[p] for p in PHASES}, busy,
            )
        )
    return out


def overview(conn: sqlite3.Connection, session: str, attempt: int, width: int = 200) -> Overview:
    """Everything the TUI overview draws for a run, in a few thousand rows whatever its length."""
    span = run_span(conn, session, attempt)
    ranks = rank_medians(conn, session, attempt)
    nodes_series = node_series(conn, session, attempt, width, span)
    nodes = []
    for node_rank, members, worst in by_node_with_worst(
        ranks, lambda r: r.node_rank, lambda r: r.step_ms_median, lambda r: r.busy_ms_median
    ):
        timed = [r for r in members if r.step_ms_median is not None]
        nodes.append(
            NodeOverview(
                node_rank,
                members[0].hostname,
                [r.global_rank if r.global_rank is not None else -r.rank_id for r in members],
                _median([r.step_ms_median for r in timed if r.step_ms_median is not None]),
                worst.global_rank if worst else None,
            )
        )
    level = (
        choose_level(span.first_step, span.last_step, width)[0]
        if span.first_step is not None and span.last_step is not None
        else HISTORY_LEVELS[0]
    )
    series = run_series(conn, session, attempt, width, span)
    return Overview(session, attempt, span, ranks, nodes, series, nodes_series, level)
