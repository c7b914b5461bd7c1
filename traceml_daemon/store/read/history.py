"""The whole run from the history tables (v2+), which survive retention deleting raw steps.

The queries are ``store.history``'s (its reading side); this module adds whether a
database has the tables at all (a v1 database falls back to raw reads) and takes
a ``RunRef`` like the rest of the read layer.
"""

from __future__ import annotations

import sqlite3

from traceml_daemon.store import history
from traceml_daemon.store.read.runs import RunRef

RunSpan = history.RunSpan
Point = history.Point


def has_history(conn: sqlite3.Connection) -> bool:
    """The v2 history tables exist (a v1 database falls back to raw reads)."""
    row = conn.execute(
        "SELECT count(*) FROM sqlite_master WHERE type='table' AND name IN ('node_history', 'reservoir')"
    ).fetchone()
    return bool(row and row[0] == 2)


def run_span(conn: sqlite3.Connection, run: RunRef) -> RunSpan:
    """The run's first and last step and their times: a few rows per node."""
    return history.run_span(conn, run.session, run.attempt)


def run_series(conn: sqlite3.Connection, run: RunRef, width: int, span: RunSpan | None = None) -> list[Point]:
    """The whole run's step-time series across ranks, at most about ``width`` points."""
    return history.run_series(conn, run.session, run.attempt, width, span)
