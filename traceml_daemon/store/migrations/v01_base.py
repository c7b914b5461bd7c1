"""v1: the first schema. Its telemetry tables are today's wire tables (a fresh
database starts with every column), so later steps that add columns rebuild a
table rather than ALTER it; ``ranks`` and the per-rank indexes are v1's own and
later steps replace them (v4, v6)."""

from __future__ import annotations

from traceml_daemon.store.schema import telemetry_table_ddl
from traceml_wire.tables import TABLES

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


def statements() -> list[str]:
    return _BASE + [telemetry_table_ddl(name) for name in TABLES] + _INDEXES
