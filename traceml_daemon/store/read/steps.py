"""Step and status rows: recent windows, tails by rowid, bounds, counts, samples and ranges.

Every per-rank read names the rank through ``schema.rank_is`` so it searches the
steps index; set-based reads (one statement for all ranks of a run) keep a
first load at thousands of ranks to a few statements.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from traceml_daemon.analysis.model import RankStatus
from traceml_daemon.store.read.runs import RunRef
from traceml_daemon.store.schema import LATER_COLUMNS, rank_is, ranks_in
from traceml_wire.tables import columns

# The step columns readers use, in the wire's order (``analysis.rolling.STEP_COLUMNS``
# less ``model_id``), so rows transpose into the batches a ``RankWindow`` takes. Columns
# appended by a later schema step are left out: a database not migrated yet lacks them
# (store.read.fsdp2 reads the FSDP2 ones where they exist).
STEP_COLS: tuple[str, ...] = tuple(
    c for c in columns("steps") if c != "model_id" and c not in LATER_COLUMNS.get("steps", {})
)
_SELECT_STEPS = ", ".join(STEP_COLS)
_STATUS_COLS = "ts, phase, phase_since, step, steps_done, finished"
_RUN_RANKS = "r.session=? AND r.attempt=? AND r.rank_id>?"


def status_from_row(row: Sequence[Any]) -> RankStatus | None:
    """A status row (``ts, phase, phase_since, step, steps_done, finished``) as a RankStatus."""
    ts, phase, since, step, done, finished = row
    if ts is None:
        return None
    return RankStatus(ts, phase or "idle", since if since is not None else ts, step, done or 0, bool(finished))


# ---------------------------------------------------------------- a run's ranks at once


def step_bounds(conn: sqlite3.Connection, run: RunRef, after: int = 0) -> Iterator[tuple[int, Any, Any]]:
    """(rank_id, first step, last step) of every rank of ``run`` with rank_id > ``after``.

    One statement: each correlated MIN/MAX is a seek of the steps index.
    """
    return conn.execute(
        f"SELECT r.rank_id, (SELECT MIN(step) FROM steps s WHERE {rank_is('r.rank_id', 's.rank_id')}), "
        f"(SELECT MAX(step) FROM steps s WHERE {rank_is('r.rank_id', 's.rank_id')}) "
        f"FROM ranks r WHERE {_RUN_RANKS}",
        (run.session, run.attempt, after),
    )


def recent_steps(
    conn: sqlite3.Connection, run: RunRef, window: int, after: int = 0, through_rowid: int | None = None
) -> Iterator[tuple[Any, ...]]:
    """(rank_id, *STEP_COLS) of the newest ``window`` steps of every rank of ``run``
    with rank_id > ``after``, and rowid <= ``through_rowid`` when given (rows past it
    are left to ``steps_after``, so none is read twice).

    One statement for all ranks: the per-rank MAX(step) bounds an index range
    scan, so it reads ``window`` rows per rank whatever the run's length.
    """
    cols = ", ".join(f"s.{c}" for c in STEP_COLS)
    upto = "" if through_rowid is None else " AND s.rowid <= ?"
    params: tuple[Any, ...] = (run.session, run.attempt, after, window)
    return conn.execute(
        f"SELECT s.rank_id, {cols} FROM ranks r CROSS JOIN steps s "
        f"WHERE {_RUN_RANKS} AND {rank_is('r.rank_id', 's.rank_id')} "
        f"AND s.step > (SELECT MAX(step) FROM steps m WHERE {rank_is('r.rank_id', 'm.rank_id')}) - ?{upto}",
        params if through_rowid is None else (*params, through_rowid),
    )


def latest_status(conn: sqlite3.Connection, run: RunRef, after: int = 0) -> Iterator[tuple[Any, ...]]:
    """(rank_id, ts, phase, phase_since, step, steps_done, finished): each rank's newest status row."""
    return conn.execute(
        "SELECT st.rank_id, st.ts, st.phase, st.phase_since, st.step, st.steps_done, st.finished "
        f"FROM ranks r CROSS JOIN status st WHERE {_RUN_RANKS} AND st.rowid = "
        "(SELECT x.rowid FROM status x WHERE x.rank_id=r.rank_id ORDER BY x.ts DESC LIMIT 1)",
        (run.session, run.attempt, after),
    )


# ---------------------------------------------------------------- tails: what was appended


def last_rowids(conn: sqlite3.Connection) -> tuple[int, int]:
    """The newest rowid of ``steps`` and of ``status``: where the tails start."""
    steps = conn.execute("SELECT COALESCE(MAX(rowid), 0) FROM steps").fetchone()[0]
    status = conn.execute("SELECT COALESCE(MAX(rowid), 0) FROM status").fetchone()[0]
    return int(steps), int(status)


def steps_after(conn: sqlite3.Connection, rowid: int) -> Iterator[tuple[Any, ...]]:
    """(rowid, rank_id, *STEP_COLS) of every step row appended after ``rowid``.

    Rows are only ever appended, so ``rowid > last`` is exactly what is new: a
    search of the table's rowid, whatever its size.
    """
    return conn.execute(f"SELECT rowid, rank_id, {_SELECT_STEPS} FROM steps WHERE rowid>?", (rowid,))


def status_after(conn: sqlite3.Connection, rowid: int) -> Iterator[tuple[Any, ...]]:
    """(rowid, rank_id, ts, phase, phase_since, step, steps_done, finished) appended after ``rowid``."""
    return conn.execute(f"SELECT rowid, rank_id, {_STATUS_COLS} FROM status WHERE rowid>?", (rowid,))


# ---------------------------------------------------------------- one rank


def rank_steps(conn: sqlite3.Connection, rank_id: int, last_n: int | None) -> list[tuple[Any, ...]]:
    """STEP_COLS rows of a rank, oldest first: all of them, or the newest ``last_n``."""
    if last_n is None:
        return conn.execute(
            f"SELECT {_SELECT_STEPS} FROM steps WHERE {rank_is('?1')} ORDER BY step", (rank_id,)
        ).fetchall()
    # Newest N through the steps index, then back to oldest-first.
    rows = conn.execute(
        f"SELECT {_SELECT_STEPS} FROM steps WHERE {rank_is('?1')} ORDER BY step DESC LIMIT ?2", (rank_id, last_n)
    ).fetchall()
    rows.reverse()
    return rows


def rank_status(conn: sqlite3.Connection, rank_id: int) -> RankStatus | None:
    row = conn.execute(
        f"SELECT {_STATUS_COLS} FROM status WHERE rank_id=? ORDER BY ts DESC LIMIT 1", (rank_id,)
    ).fetchone()
    return None if row is None else status_from_row(row)


@dataclass(frozen=True)
class StepCounts:
    """A rank's stored steps, counted in SQL (index only): exact however many were loaded."""

    total: int
    first: int | None
    last: int | None


# Rank ids per statement of step_counts: two parameters' worth of SQL each,
# well inside SQLite's 32,766 bound parameters.
_COUNT_CHUNK = 4096


def step_counts(conn: sqlite3.Connection, rank_ids: list[int]) -> dict[int, StepCounts]:
    """Each rank's stored steps (count, first, last) in one pass over their groups' index
    entries: a count per rank walks its whole group (schema v4), so one statement per
    rank of a group would walk it RANK_GROUP times."""
    out = dict.fromkeys(rank_ids, StepCounts(0, None, None))
    for i in range(0, len(rank_ids), _COUNT_CHUNK):
        part = rank_ids[i : i + _COUNT_CHUNK]
        for rank_id, total, first, last in conn.execute(
            f"SELECT rank_id, count(*), min(step), max(step) FROM steps WHERE {ranks_in(len(part))} GROUP BY rank_id",
            part,
        ):
            out[rank_id] = StepCounts(total, first, last)
    return out


def rank_step_counts(conn: sqlite3.Connection, rank_id: int) -> StepCounts:
    return step_counts(conn, [rank_id])[rank_id]


# Step numbers per IN (...) list when fetching chosen steps of a rank: well under SQLite's parameter limit.
_IN_CHUNK = 500


def sampled_steps(conn: sqlite3.Connection, rank_id: int, counts: StepCounts, cap: int, tail: int) -> list[tuple[Any, ...]]:
    """At most about ``cap`` rows of a rank: every k-th step over the whole run (creep and
    whole-run medians keep their shape under uniform thinning) plus the newest ``tail``
    steps dense (the windows the step verdicts and liveness read). The first and the
    last step are always in it, so only the count needs ``counts``."""
    if counts.total <= cap or counts.first is None or counts.last is None:
        return rank_steps(conn, rank_id, None)
    tail = max(1, min(tail, cap // 2))  # at least half the budget samples the whole run
    every = -(-counts.total // max(1, cap - tail))
    if counts.last - counts.first + 1 == counts.total:
        # Contiguous step numbers (the usual case): the chosen steps by arithmetic, each
        # a seek of the index. (A filter ``(step - first) % every = 0`` would walk every
        # entry of the rank's group, RANK_GROUP x the rank's own.)
        chosen = sorted({*range(counts.first, counts.last + 1, every), *range(counts.last - tail + 1, counts.last + 1)})
    else:
        # Gaps or a stride (e.g. one row per optimizer step of accumulated micro-steps),
        # where every k-th step number could alias and select nothing: every k-th of the
        # steps themselves, read from the index.
        steps = [row[0] for row in conn.execute(f"SELECT step FROM steps WHERE {rank_is('?1')} ORDER BY step", (rank_id,))]
        chosen = sorted(set(steps[::every]) | set(steps[-tail:]))
    return rows_at_steps(conn, rank_id, _SELECT_STEPS, chosen, "step")


def rows_at_steps(
    conn: sqlite3.Connection, rank_id: int, select: str, steps: Sequence[int], order: str
) -> list[tuple[Any, ...]]:
    """``select`` of the rank's step rows at these step numbers (sorted), by index seeks in
    chunks of ``_IN_CHUNK``, ordered by ``order`` within each chunk."""
    rows: list[tuple[Any, ...]] = []
    for i in range(0, len(steps), _IN_CHUNK):
        part = steps[i : i + _IN_CHUNK]
        rows += conn.execute(
            f"SELECT {select} FROM steps WHERE {rank_is('?1')} AND step IN ({','.join('?' * len(part))}) "
            f"ORDER BY {order}",
            (rank_id, *part),
        ).fetchall()
    return rows


def steps_in_range(
    conn: sqlite3.Connection, rank_id: int, first: int | None, last: int | None, *, by_time: bool = False
) -> Iterator[tuple[Any, ...]]:
    """STEP_COLS rows of a rank with ``first <= step <= last`` (None: open end), in step
    order, or by ``ts`` (then step) with ``by_time``."""
    where, params = "", [rank_id]
    if first is not None:
        where += " AND step >= ?"
        params.append(first)
    if last is not None:
        where += " AND step <= ?"
        params.append(last)
    order = "ts, step" if by_time else "step, ts"
    return conn.execute(
        f"SELECT {_SELECT_STEPS} FROM steps WHERE {rank_is('?1')}{where} ORDER BY {order}", params
    )


def earliest_step_start(conn: sqlite3.Connection, rank_ids: list[int]) -> float | None:
    """The earliest wall-clock second at which a step of these ranks began (its end
    less its step and dataloader time), finite values only (a stored infinity is not
    a time)."""
    if not rank_ids:
        return None
    row = conn.execute(
        "SELECT MIN(start) FROM (SELECT ts - COALESCE(step_ns, 0) / 1e9 - COALESCE(dataloader_ns, 0) / 1e9 AS start "
        f"FROM steps WHERE {ranks_in(len(rank_ids))}) WHERE start BETWEEN -1e300 AND 1e300",
        rank_ids,
    ).fetchone()
    return None if row is None or row[0] is None else float(row[0])
