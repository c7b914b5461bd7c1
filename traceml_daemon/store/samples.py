"""Each rank's newest host samples (tables ``process``, ``system``, ``gpu``).

Schema v4 indexes those tables by (time slice, rank, ts) (``schema.SAMPLE_SLICE``),
so a commit writes to the current slice's pages instead of one page per rank. A
rank's newest rows are then read slice by slice, newest first: one query seeks
every slice of a stretch for that rank (an ``IN`` list on the index's first
column), and stretches go back until enough rows are found or ``SPAN_S`` before
the rank's last flush is searched. The last flush is the rank's status row (one
per rank), written with the samples of the same flush.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from traceml_daemon.store.schema import SAMPLE_SLICE, SAMPLE_SLICE_S, SAMPLE_TABLES

# How far before its last flush a rank's samples are looked for: a rank that flushes
# once a second has 600 of each; a rank with none (another rank samples the host) costs
# SPAN_S / SAMPLE_SLICE_S seeks, in SPAN_S / SAMPLE_SLICE_S / SLICES_PER_QUERY queries.
SPAN_S = 600.0
SLICES_PER_QUERY = 50


def last_flush_ts(conn: sqlite3.Connection, table: str, rank_id: int) -> float | None:
    """When ``rank_id`` last flushed (its status row), else the newest sample of ``table``."""
    row = conn.execute("SELECT ts FROM status WHERE rank_id=?", (rank_id,)).fetchone()
    if row is not None and row[0] is not None:
        return float(row[0])
    row = conn.execute(f"SELECT max({SAMPLE_SLICE}) FROM {table}").fetchone()
    return None if row is None or row[0] is None else float((row[0] + 1) * SAMPLE_SLICE_S)


def newest(conn: sqlite3.Connection, table: str, cols: str, rank_id: int, limit: int) -> list[tuple[Any, ...]]:
    """``rank_id``'s newest ``limit`` rows of ``table`` (``cols``, an SQL column list), newest first."""
    if table not in SAMPLE_TABLES:
        raise ValueError(f"{table!r} is not a host-sample table ({', '.join(SAMPLE_TABLES)})")
    if limit <= 0:
        return []
    end = last_flush_ts(conn, table, rank_id)
    if end is None:
        return []
    top = int(end // SAMPLE_SLICE_S) + 1  # one slice of slack: the samples' clock is the flush's
    bottom = top - int(SPAN_S // SAMPLE_SLICE_S)
    marks = ",".join("?" * SLICES_PER_QUERY)
    sql = f"SELECT {cols} FROM {table} WHERE {SAMPLE_SLICE} IN ({marks}) AND rank_id=? ORDER BY ts DESC LIMIT ?"
    out: list[tuple[Any, ...]] = []
    hi = top
    while len(out) < limit and hi > bottom:
        slices = range(hi, hi - SLICES_PER_QUERY, -1)
        out += conn.execute(sql, (*slices, rank_id, limit - len(out))).fetchall()
        hi -= SLICES_PER_QUERY
    return out
