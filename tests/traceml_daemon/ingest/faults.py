"""Failures injected inside SQLite, for the writer's tests: one the data causes
(the rows would fail again, so they are set aside) and one it does not (the
database or the machine failed: nothing is acknowledged and the senders resend)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from traceml_daemon.store.migrate import migrate

# What a failing trigger runs: RAISE is a constraint failure (sqlite3.IntegrityError),
# the data's fault; a malformed json() argument fails the statement with SQLITE_ERROR
# at run time (sqlite3.OperationalError), as a full disk or an I/O error does.
_BODIES = {
    "data": "SELECT RAISE(ABORT, 'injected')",
    "io": "SELECT json('injected failure, not the data''s')",
}


def failing_inserts(db: Path, table: str, when: str = "1", kind: str = "io") -> sqlite3.Connection:
    """A migrated database at ``db`` where every INSERT into ``table`` whose row matches
    ``when`` (SQL over NEW) fails inside SQLite (a real error, rolling the transaction
    back; ``kind`` "io" or "data", above) while meta 'fail' is '1'. Returns an
    autocommit connection: set it to '0' to heal."""
    migrate(str(db))
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("INSERT INTO meta VALUES ('fail', '1')")
    conn.execute(f"CREATE TRIGGER fail_{table} BEFORE INSERT ON {table} WHEN ({when}) "
                 f"AND (SELECT value FROM meta WHERE key='fail')='1' BEGIN {_BODIES[kind]}; END")
    return conn
