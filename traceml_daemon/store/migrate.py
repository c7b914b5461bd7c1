"""Bring a database to the code's schema version, or refuse one that is newer.

Synchronous stdlib sqlite3 on purpose: it runs once at startup, before the
async writer opens its connection, and the CLI's ingest path shares it.
"""

from __future__ import annotations

import sqlite3
import time

from traceml_daemon.store.migrations import MIGRATIONS
from traceml_daemon.store.schema import PRAGMAS, SCHEMA_VERSION


class SchemaError(RuntimeError):
    """The database cannot be used by this version of the code."""


def current_version(conn: sqlite3.Connection) -> int:
    """0 for an empty database; raises SchemaError for a foreign one."""
    tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    if not tables:
        return 0
    if "meta" not in tables:
        raise SchemaError("not a traceml database (no meta table)")
    row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    if row is None:
        raise SchemaError("not a traceml database (no schema_version in meta)")
    try:
        return int(row[0])
    except ValueError:
        raise SchemaError(f"not a traceml database (schema_version {row[0]!r})") from None


def migrate(path: str) -> int:
    """Apply every pending step of MIGRATIONS, each in its own transaction.

    Returns the version the database is now at.
    """
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        try:
            for pragma in PRAGMAS:
                conn.execute(pragma)
            version = current_version(conn)
        except sqlite3.DatabaseError as exc:
            raise SchemaError(f"{path} is not a traceml database ({exc})") from None
        if version > SCHEMA_VERSION:
            raise SchemaError(
                f"{path} has schema version {version}, newer than this traceml-daemon "
                f"understands ({SCHEMA_VERSION}); upgrade traceml-daemon to open it"
            )
        while version < SCHEMA_VERSION:
            conn.execute("BEGIN IMMEDIATE")
            try:
                for statement in MIGRATIONS[version]:
                    conn.execute(statement)
                version += 1
                conn.execute(
                    "INSERT INTO meta(key, value) VALUES('schema_version', ?) "
                    "ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                    (str(version),),
                )
                conn.execute(
                    "INSERT OR IGNORE INTO meta(key, value) VALUES('created_at', ?)", (repr(time.time()),)
                )
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        return version
    finally:
        conn.close()
