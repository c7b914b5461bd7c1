"""History read back for whole-run views: series at a fitting level, medians, overview.

``overview(conn, session, attempt, width)`` is everything the TUI's overview draws
for a run, in a few thousand rows whatever its length: series from the coarsest
level that gives about ``width`` points (``choose_level``), per-rank medians from
the reservoir sample. Plain stdlib sqlite3 connections (the readers').
"""

from __future__ import annotations

import math
import sqlite3
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from traceml_daemon.analysis.nodes import by_node_with_worst
from traceml_daemon.store.history_buckets import BASE, Stats, merge_into
from traceml_daemon.store.history_sql import RESERVOIR_COLUMNS, STAT_COLUMNS
from traceml_daemon.store.schema import HISTORY_LEVELS, HISTORY_METRICS, LATEST_SLOT
from traceml_wire.tables import PHASES


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
        cnt, lo, hi, total = stats[BASE + 4 * j : BASE + 4 * j + 4]
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


_STAT_SELECT = ", ".join(STAT_COLUMNS)


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
    cols = ", ".join(f"s.{c}" for c in RESERVOIR_COLUMNS[2:])
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
