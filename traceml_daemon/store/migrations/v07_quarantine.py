"""v7: quarantine, and non-finite scalars found cheaply.

A batch that cannot be stored (it fails validation, or a transaction holding it
fails and it fails again alone) is set aside here with its sender, seq and the
reason, so the daemon acknowledges it and goes on instead of retrying it into a
crash (traceml_daemon/ingest/quarantine.py). Only text the daemon cut short and
bytes: nothing in a row can fail to store for the data it describes. ``seq`` is
text because a refused seq may not fit an INTEGER.

Non-finite scalars sit in a partial index readers reach by repeating its WHERE
expression, ``NONFINITE_SCALAR`` (store/schema.py)."""

from __future__ import annotations

from traceml_daemon.store.schema import NONFINITE_SCALAR


def statements() -> list[str]:
    return [
        "CREATE TABLE quarantine (id INTEGER PRIMARY KEY, ts REAL NOT NULL, relay TEXT, sender TEXT, seq TEXT, "
        "reason TEXT NOT NULL, body BLOB, body_bytes INTEGER NOT NULL DEFAULT 0)",
        f"CREATE INDEX scalars_nonfinite ON scalars (rank_id, name, step) WHERE {NONFINITE_SCALAR}",
    ]
