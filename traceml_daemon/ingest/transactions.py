"""One ingest transaction, run whole on the database thread, and the chain they queue in.

Every aiosqlite call is a round trip through the event loop and a GIL hand-off,
and while the loop is busy decoding each hand-off can wait a whole switch
interval; so a transaction is one call (``store/db_thread.py``): BEGIN, every
statement, COMMIT. Transactions are queued on that thread one behind another
(the writer stages the next against the dedup marks of those ahead), so once
one fails the ones queued behind it are skipped (``Chain``).
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

from traceml_daemon.ingest.hygiene import trim_heap
from traceml_daemon.store.statements import Statement

_chain = chain.from_iterable


def run_transaction(
    conn: sqlite3.Connection,
    statements: list[Statement],
    head: Callable[[], Iterable[Statement]] | None = None,
    trim: bool = False,
    tables: Sequence[Callable[[], list[Statement]]] = (),
) -> None:
    """The whole transaction in one call on the database thread.

    ``head`` (history) runs here too, on this thread, and its statements go first;
    so do ``tables``, which build the telemetry rows' statements (see ``Staged``).
    ``trim``: hand the heap's free pages back once committed."""
    todo: Iterable[Statement] = statements if head is None else chain(head(), statements)
    if tables:
        todo = chain(todo, _chain(build() for build in tables))
    conn.execute("BEGIN IMMEDIATE")
    try:
        for sql, params in todo:
            conn.execute(sql, params)
        conn.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        raise
    if trim:
        trim_heap()


class Skipped(Exception):
    """A transaction queued behind one that failed was not run."""


@dataclass
class Chain:
    """Transactions queued on the database thread one behind another. Each was staged
    against the dedup marks of those ahead of it, so once one fails (``broken``, set on
    the database thread) the ones behind it must not commit either. ``recoverable``
    (set in the event loop by the failed one, before the ones behind it finish): the
    failure was its data's, so those are staged again and written, not left unacknowledged."""

    broken: bool = False
    recoverable: bool = False
    disk_full: bool = False  # set with ``recoverable``: the failure was a full disk (ingest/disk_full.py)


def run_chained(conn: sqlite3.Connection, queued: Chain, *args: Any) -> None:
    """``run_transaction(conn, *args)`` unless an earlier transaction of ``queued`` failed."""
    if queued.broken:
        raise Skipped
    try:
        run_transaction(conn, *args)
    except BaseException:
        queued.broken = True
        raise
