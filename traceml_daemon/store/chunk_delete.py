"""One retention delete as its own short transaction on the database thread."""

from __future__ import annotations

import contextlib
import sqlite3
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the command line reads retention without loading aiosqlite
    import aiosqlite


async def delete_chunk(db: aiosqlite.Connection, sql: str, params: tuple[float | int | str, ...]) -> int:
    """Run one DELETE in its own transaction; rows deleted.

    One call on the database thread: the writer queues its next transaction on that
    thread while the previous one runs, and one queued between this BEGIN and COMMIT
    would begin inside it."""
    from traceml_daemon.store.db_thread import on_db_thread  # loads aiosqlite: not at the CLI's import

    return int(await on_db_thread(db, _delete_chunk_now, sql, params))


def _delete_chunk_now(conn: sqlite3.Connection, sql: str, params: tuple[float | int | str, ...]) -> int:
    conn.execute("BEGIN IMMEDIATE")
    try:
        deleted = conn.execute(sql, params).rowcount
        conn.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        raise
    return max(0, deleted)
