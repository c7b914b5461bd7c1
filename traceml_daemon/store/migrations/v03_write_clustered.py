"""v3: history clustered by write time; status keeps one row per rank.

One history write upserts the current bucket of every rank at every level (and
every rank's latest reservoir point). Keyed rank first, those rows sat on a
different page per rank: at thousands of ranks a write dirtied a page per rank and
level, about half of the daemon's disk writes (bench/ingest.py, /proc/PID/io) for
a few MB of rows. Keyed by what a write has in common (level, bucket; the slot)
the rows of one write sit side by side, a few hundred pages. Readers ask for whole
levels (every rank of the run), a prefix of the new keys."""

from __future__ import annotations

from traceml_daemon.store.migrations.v02_history import metric_columns
from traceml_wire.tables import PHASES


def _rekey(table: str, columns_ddl: str, key: str) -> list[str]:
    """Rebuild ``table`` (WITHOUT ROWID) under a new primary key, keeping its rows
    (``columns_ddl`` lists the columns in the table's order: rows copy by position)."""
    return [
        f"CREATE TABLE {table}_rekeyed ({columns_ddl}, PRIMARY KEY ({key})) WITHOUT ROWID",
        f"INSERT INTO {table}_rekeyed SELECT * FROM {table}",
        f"DROP TABLE {table}",
        f"ALTER TABLE {table}_rekeyed RENAME TO {table}",
    ]


def statements() -> list[str]:
    metrics = metric_columns()
    return [
        *_rekey(
            "rank_history",
            "rank_id INTEGER NOT NULL, level INTEGER NOT NULL, bucket INTEGER NOT NULL, n INTEGER NOT NULL, "
            f"first_step INTEGER, last_step INTEGER, last_ts REAL, {metrics}",
            "level, bucket, rank_id",
        ),
        *_rekey(
            "node_history",
            "session TEXT NOT NULL, attempt INTEGER NOT NULL, node_rank INTEGER NOT NULL, level INTEGER NOT NULL, "
            f"bucket INTEGER NOT NULL, n INTEGER NOT NULL, first_step INTEGER, last_step INTEGER, last_ts REAL, "
            f"{metrics}",
            "session, attempt, level, bucket, node_rank",
        ),
        *_rekey(
            "reservoir",
            "rank_id INTEGER NOT NULL, slot INTEGER NOT NULL, step INTEGER, ts REAL, step_ns INTEGER, "
            + ", ".join(f"{p}_ns INTEGER" for p in PHASES),
            "slot, rank_id",
        ),
        # status: only each rank's newest row was ever read (the TUI, summaries), yet
        # every flush of every rank appended one, each into the rank's own page of a
        # (rank_id, ts) index. One row per rank now, replaced on every flush: a
        # replaced row gets a new, higher rowid, so readers that tail ``rowid > last``
        # still see every change.
        "DELETE FROM status WHERE rowid NOT IN (SELECT (SELECT x.rowid FROM status x WHERE x.rank_id = r.rank_id "
        "ORDER BY x.ts DESC, x.rowid DESC LIMIT 1) FROM (SELECT DISTINCT rank_id FROM status) r)",
        "DROP INDEX IF EXISTS status_by_rank",
        "CREATE UNIQUE INDEX status_one_per_rank ON status (rank_id)",
    ]
