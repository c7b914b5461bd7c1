"""The SQLite schema: typed columns per table, mirrored from the wire tables.

Every telemetry table is the wire table of the same name plus ``rank_id``,
the integer key of the sending rank in ``ranks``. Column types follow
``traceml_wire.tables.TABLES``. Bump ``SCHEMA_VERSION`` and append a step to
``MIGRATIONS`` for every change; never edit a released step.
"""

from __future__ import annotations

from traceml_wire.tables import INT, REAL, TABLES, TEXT

SCHEMA_VERSION = 1

_SQL_TYPES = {INT: "INTEGER", REAL: "REAL", TEXT: "TEXT"}


def telemetry_table_ddl(name: str) -> str:
    cols = ", ".join(f"{col} {_SQL_TYPES[kind]}" for col, kind in TABLES[name])
    return f"CREATE TABLE IF NOT EXISTS {name} (rank_id INTEGER NOT NULL, {cols})"


_BASE = [
    # key/value facts about the database: schema_version, created_at, ...
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)",
    # One row per (session, attempt, sender): a rank process as seen by the daemon.
    """CREATE TABLE IF NOT EXISTS ranks (
        rank_id INTEGER PRIMARY KEY,
        sender TEXT NOT NULL UNIQUE,
        session TEXT NOT NULL,
        attempt INTEGER NOT NULL DEFAULT 0,
        global_rank INTEGER, local_rank INTEGER, node_rank INTEGER,
        world_size INTEGER, local_world_size INTEGER, nnodes INTEGER,
        hostname TEXT, pid INTEGER, run_id TEXT, parallelism TEXT, device TEXT,
        first_seen REAL, last_seen REAL,
        last_seq INTEGER NOT NULL DEFAULT 0  -- highest agent batch stored (dedup)
    )""",
    "CREATE INDEX IF NOT EXISTS ranks_by_node ON ranks (session, attempt, node_rank, global_rank)",
    # Cumulative delivery counters per source (agent sender, relay, daemon).
    """CREATE TABLE IF NOT EXISTS delivery (
        source TEXT NOT NULL, counter TEXT NOT NULL, value INTEGER NOT NULL,
        PRIMARY KEY (source, counter)
    )""",
]

_INDEXES = [
    "CREATE INDEX IF NOT EXISTS steps_by_rank ON steps (rank_id, step)",
    "CREATE INDEX IF NOT EXISTS scalars_by_rank ON scalars (rank_id, name, step)",
    "CREATE INDEX IF NOT EXISTS process_by_rank ON process (rank_id, ts)",
    "CREATE INDEX IF NOT EXISTS system_by_rank ON system (rank_id, ts)",
    "CREATE INDEX IF NOT EXISTS gpu_by_rank ON gpu (rank_id, ts)",
    "CREATE INDEX IF NOT EXISTS spans_by_rank ON spans (rank_id, start_ns)",
    "CREATE INDEX IF NOT EXISTS layers_by_rank ON layers (rank_id, step)",
    "CREATE INDEX IF NOT EXISTS status_by_rank ON status (rank_id, ts)",
    "CREATE INDEX IF NOT EXISTS models_by_rank ON models (rank_id, model_id)",
    "CREATE INDEX IF NOT EXISTS drops_by_rank ON drops (rank_id, source)",
]


def _v1() -> list[str]:
    return _BASE + [telemetry_table_ddl(name) for name in TABLES] + _INDEXES


# MIGRATIONS[i] brings a database from version i to i + 1.
MIGRATIONS: list[list[str]] = [_v1()]

PRAGMAS = [
    "PRAGMA journal_mode=WAL",
    "PRAGMA synchronous=NORMAL",
    "PRAGMA temp_store=MEMORY",
]
