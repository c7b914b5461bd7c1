"""Rank output: the stdout and stderr lines agents captured (table ``output``, schema v8).

Per-rank reads go through the ``output_by_group`` index (rank group, ts, rank):
a rank's newest N lines, or its lines within a time range, are bounded whatever
the run's length. ``output_after`` tails the table by rowid (``logs --follow``).
Rows are (ts, stream, seq, line) unless a function says otherwise.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from typing import Any

from traceml_daemon.store.read.connect import has_table
from traceml_daemon.store.schema import rank_is

OutputRow = tuple[Any, ...]  # (ts, stream, seq, line)

# A stored line is read at most this long (the agent cuts at 4096 characters; a hostile
# peer's longer text is cut here, before any reader holds or prints it).
MAX_LINE_CHARS = 4096
_LINE = f"substr(line, 1, {MAX_LINE_CHARS})"


def has_output(conn: sqlite3.Connection) -> bool:
    """The database has the output table (schema v8 or later)."""
    return has_table(conn, "output")


def rank_output(conn: sqlite3.Connection, rank_id: int, last_n: int) -> list[OutputRow]:
    """The rank's newest ``last_n`` lines, oldest first."""
    rows = conn.execute(
        f"SELECT ts, stream, seq, {_LINE} FROM output WHERE {rank_is('?1')} ORDER BY ts DESC, seq DESC LIMIT ?2",
        (rank_id, last_n),
    ).fetchall()
    rows.reverse()
    return rows


def output_between(conn: sqlite3.Connection, rank_id: int, t0: float, t1: float, limit: int) -> list[OutputRow]:
    """At most ``limit`` of the rank's lines read with ``t0 <= ts <= t1``, oldest first."""
    return conn.execute(
        f"SELECT ts, stream, seq, {_LINE} FROM output WHERE {rank_is('?1')} AND ts BETWEEN ?2 AND ?3 "
        "ORDER BY ts, seq LIMIT ?4",
        (rank_id, t0, t1, limit),
    ).fetchall()


def last_output_rowid(conn: sqlite3.Connection) -> int:
    return int(conn.execute("SELECT COALESCE(MAX(rowid), 0) FROM output").fetchone()[0])


def output_after(conn: sqlite3.Connection, rowid: int, limit: int) -> Iterator[tuple[Any, ...]]:
    """(rowid, rank_id, ts, stream, seq, line) of at most ``limit`` lines stored after
    ``rowid``, in rowid order (a search of the rowid, whatever the table's size)."""
    return conn.execute(
        f"SELECT rowid, rank_id, ts, stream, seq, {_LINE} FROM output WHERE rowid>? ORDER BY rowid LIMIT ?",
        (rowid, limit),
    )


# A failure's traceback is printed at the end of the rank's output: its newest lines hold it.
FAILURE_SCAN_LINES = 400
FAILURE_TAIL_LINES = 20


def first_failure(
    conn: sqlite3.Connection, ranks: list[tuple[int, int]], scan: int = FAILURE_SCAN_LINES, tail: int = FAILURE_TAIL_LINES
) -> dict[str, Any] | None:
    """The rank whose traceback came first among ``ranks`` ((rank_id, global_rank)), read
    from each rank's newest ``scan`` lines: its global rank, when, the exception line,
    the traceback, its last ``tail`` lines, and every rank that printed one (None: none)."""
    from traceml_daemon.analysis.output_fold import OutputLine, split_tracebacks, unprefixed
    from traceml_daemon.analysis.output_fold import first_failure as first_of

    if not has_output(conn):
        return None
    found = []
    lines_of: dict[int, list[OutputLine]] = {}
    for rank_id, global_rank in ranks:
        lines = [OutputLine(global_rank, *row) for row in rank_output(conn, rank_id, scan)]
        tracebacks, _ = split_tracebacks(lines)
        if tracebacks:
            found.append(tracebacks[0])
            lines_of[global_rank] = lines
    first = first_of(found)
    if first is None:
        return None
    return {
        "global_rank": first.global_rank,
        "ts": first.ts,
        "exception": first.exception,
        "traceback": list(first.lines),
        "last_lines": [unprefixed(x.line) for x in lines_of[first.global_rank][-tail:]],
        "ranks_with_traceback": sorted(tb.global_rank for tb in found),
    }
