"""Read-only connections to a traceml database, and what they tell without reading telemetry.

Readers open ``file:PATH?mode=ro``: they never take the write lock, so they
never block the daemon's writer (WAL), and work the same on a finished run.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from traceml_daemon.store.schema import SCHEMA_VERSION


class StoreError(RuntimeError):
    """The path is missing or is not a readable traceml database."""


def open_readonly(path: str) -> sqlite3.Connection:
    """Open ``path`` read-only and check it is a traceml database of a known version."""
    if not os.path.exists(path):
        raise StoreError(f"{path}: no such database (start `traceml-daemon serve --db {path}` first)")
    try:
        conn = sqlite3.connect(f"file:{os.path.abspath(path)}?mode=ro", uri=True)
        version = schema_version(conn)
    except sqlite3.Error as exc:
        raise StoreError(f"{path}: not a traceml database ({exc})") from None
    if version is None:
        conn.close()
        raise StoreError(f"{path}: not a traceml database (no schema_version)")
    if version > SCHEMA_VERSION:
        conn.close()
        raise StoreError(f"{path}: schema version {version} is newer than this traceml-daemon ({SCHEMA_VERSION}); upgrade")
    return conn


def connect(path: str, *, any_thread: bool = False) -> sqlite3.Connection:
    """A read-only connection without checks: a live view shows whatever is there yet.

    ``any_thread``: the TUI reads from thread workers, one at a time per connection.
    """
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=not any_thread)


def connect_file(path: Path) -> sqlite3.Connection:
    """A read-only connection to ``path`` named by a file URI, so '?' or '#' in a name stay intact."""
    return sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True)


def schema_version(conn: sqlite3.Connection) -> int | None:
    try:
        row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    except sqlite3.OperationalError:
        return None
    return int(row[0]) if row else None


def table_names(conn: sqlite3.Connection) -> set[str]:
    """Every table in the database (raises sqlite3.DatabaseError on a file that is not one)."""
    return {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def has_table(conn: sqlite3.Connection, name: str) -> bool:
    row = conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?", (name,)).fetchone()
    return row is not None


def data_version(conn: sqlite3.Connection) -> int:
    """A counter that moves when another connection commits: a few microseconds, no table read."""
    return int(conn.execute("PRAGMA data_version").fetchone()[0])


@contextmanager
def snapshot(conn: sqlite3.Connection) -> Iterator[None]:
    """One read transaction: every read inside sees the same committed state."""
    conn.execute("BEGIN")
    try:
        yield
    finally:
        conn.execute("COMMIT")
