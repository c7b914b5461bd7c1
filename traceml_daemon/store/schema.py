"""The SQLite schema: typed columns per table, mirrored from the wire tables.

Every telemetry table is the wire table of the same name plus ``rank_id``,
the integer key of the sending rank in ``ranks``. Column types follow
``traceml_wire.tables.TABLES``. Bump ``SCHEMA_VERSION`` and append a step to
``MIGRATIONS`` for every change; never edit a released step.
"""

from __future__ import annotations

from traceml_wire.identity import IDENTITY, IDENTITY_NAMES, IdentityField
from traceml_wire.partials import FINE_STEPS, METRICS
from traceml_wire.tables import INT, PHASES, REAL, TABLES, TEXT

SCHEMA_VERSION = 13

_SQL_TYPES = {INT: "INTEGER", REAL: "REAL", TEXT: "TEXT"}


def telemetry_table_ddl(name: str) -> str:
    cols = ", ".join(f"{col} {_SQL_TYPES[kind]}" for col, kind in TABLES[name])
    return f"CREATE TABLE IF NOT EXISTS {name} (rank_id INTEGER NOT NULL, {cols})"


# Columns a later step added to a table of v1, by the version that added them: a database
# not migrated yet lacks them (readers leave them out of their common reads; validation
# expects them from that version on).
LATER_COLUMNS: dict[str, dict[str, int]] = {
    "steps": {"fwd_comm_ns": 10, "bwd_comm_ns": 10, "replicate_comm_ns": 10, "post_forward_bytes": 10,
              "device_timed": 13},
    "models": {"shard_degree": 10, "replicate_degree": 10},
}


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


# ---------------------------------------------------------------- v2: history
# Downsampled history, maintained by the writer as steps arrive (store/history.py),
# so an overview of a run of any length reads O(width) rows per series and
# survives retention deleting raw steps.

# Steps per bucket, finest first; agents send partials of the finest level
# (traceml_wire/partials.py), so it is theirs to state.
HISTORY_LEVELS = (FINE_STEPS, 1024, 16384)
HISTORY_METRICS = METRICS  # step and every phase: each is the ``{metric}_ns`` column of steps
RESERVOIR_SIZE = 256  # most raw steps sampled per rank (+ the latest point); see v5
LATEST_SLOT = -1  # reservoir slot that always holds the rank's newest step


def _metric_columns() -> str:
    # n counts non-NULL values (NULL = not measured) so mean = sum / n stays exact
    # when buckets are merged across transactions.
    return ", ".join(
        f"{m}_n INTEGER NOT NULL DEFAULT 0, {m}_min INTEGER, {m}_max INTEGER, {m}_sum INTEGER NOT NULL DEFAULT 0"
        for m in HISTORY_METRICS
    )


def _history_select(level: int) -> str:
    aggs = ", ".join(
        f"count({m}_ns), min({m}_ns), max({m}_ns), coalesce(sum({m}_ns), 0)" for m in HISTORY_METRICS
    )
    return f"{level}, step / {level}, count(*), min(step), max(step), max(ts), {aggs}"


def _v2() -> list[str]:
    metrics = _metric_columns()
    cols = ", ".join(f"{m}_n, {m}_min, {m}_max, {m}_sum" for m in HISTORY_METRICS)
    node_aggs = ", ".join(f"sum({m}_n), min({m}_min), max({m}_max), sum({m}_sum)" for m in HISTORY_METRICS)
    phase_cols = ", ".join(f"{p}_ns" for p in PHASES)
    statements = [
        f"""CREATE TABLE IF NOT EXISTS rank_history (
            rank_id INTEGER NOT NULL, level INTEGER NOT NULL, bucket INTEGER NOT NULL,
            n INTEGER NOT NULL, first_step INTEGER, last_step INTEGER, last_ts REAL, {metrics},
            PRIMARY KEY (rank_id, level, bucket)
        ) WITHOUT ROWID""",
        f"""CREATE TABLE IF NOT EXISTS node_history (
            session TEXT NOT NULL, attempt INTEGER NOT NULL, node_rank INTEGER NOT NULL,
            level INTEGER NOT NULL, bucket INTEGER NOT NULL,
            n INTEGER NOT NULL, first_step INTEGER, last_step INTEGER, last_ts REAL, {metrics},
            PRIMARY KEY (session, attempt, node_rank, level, bucket)
        ) WITHOUT ROWID""",
        f"""CREATE TABLE IF NOT EXISTS reservoir (
            rank_id INTEGER NOT NULL, slot INTEGER NOT NULL,
            step INTEGER, ts REAL, step_ns INTEGER, {", ".join(f"{p}_ns INTEGER" for p in PHASES)},
            PRIMARY KEY (rank_id, slot)
        ) WITHOUT ROWID""",
        # Reservoir sampling state (Algorithm L), so a restarted daemon samples on uniformly.
        """CREATE TABLE IF NOT EXISTS reservoir_state (
            rank_id INTEGER PRIMARY KEY, seen INTEGER NOT NULL, next_take INTEGER NOT NULL, w REAL NOT NULL
        )""",
    ]
    # Backfill from the raw steps a v1 database already holds (pure SQL, one pass per level).
    for level in HISTORY_LEVELS:
        statements.append(
            f"INSERT OR REPLACE INTO rank_history (rank_id, level, bucket, n, first_step, last_step, last_ts, {cols}) "
            f"SELECT rank_id, {_history_select(level)} FROM steps WHERE step IS NOT NULL GROUP BY rank_id, step / {level}"
        )
    statements.append(
        f"INSERT OR REPLACE INTO node_history (session, attempt, node_rank, level, bucket, n, first_step, last_step, "
        f"last_ts, {cols}) SELECT r.session, r.attempt, r.node_rank, h.level, h.bucket, sum(h.n), min(h.first_step), "
        f"max(h.last_step), max(h.last_ts), {node_aggs} FROM rank_history h JOIN ranks r USING (rank_id) "
        "WHERE r.node_rank IS NOT NULL GROUP BY r.session, r.attempt, r.node_rank, h.level, h.bucket"
    )
    # An evenly spaced sample stands in for the reservoir of old data, plus the latest point.
    statements.append(
        f"INSERT OR REPLACE INTO reservoir (rank_id, slot, step, ts, step_ns, {phase_cols}) "
        f"SELECT rank_id, rn * {RESERVOIR_SIZE} / cnt, step, ts, step_ns, {phase_cols} FROM ("
        f"SELECT *, row_number() OVER (PARTITION BY rank_id ORDER BY step) - 1 AS rn, "
        f"count(*) OVER (PARTITION BY rank_id) AS cnt FROM steps WHERE step IS NOT NULL) "
        f"WHERE (rn * {RESERVOIR_SIZE}) / cnt != ((rn + 1) * {RESERVOIR_SIZE}) / cnt OR cnt <= {RESERVOIR_SIZE}"
    )
    statements.append(
        f"INSERT OR REPLACE INTO reservoir (rank_id, slot, step, ts, step_ns, {phase_cols}) "
        f"SELECT rank_id, {LATEST_SLOT}, step, ts, step_ns, {phase_cols} FROM ("
        f"SELECT *, row_number() OVER (PARTITION BY rank_id ORDER BY step DESC, rowid DESC) AS rn FROM steps "
        "WHERE step IS NOT NULL) WHERE rn = 1"
    )
    statements.append(
        "INSERT OR REPLACE INTO reservoir_state (rank_id, seen, next_take, w) "
        "SELECT rank_id, count(*), 0, 0.0 FROM steps WHERE step IS NOT NULL GROUP BY rank_id"
    )
    return statements


# ------------------------------------------- v3: history clustered by write time
# One history write upserts the current bucket of every rank at every level (and
# every rank's latest reservoir point). Keyed rank first, those rows sat on a
# different page per rank: at 4096 ranks a write dirtied a page per rank and
# level, about half of the daemon's 112 MB/s of disk writes (bench/ingest.py,
# /proc/PID/io) for ~2 MB of rows. Keyed by what a write has in common (level,
# bucket; the slot) the rows of one write sit side by side, a few hundred pages.
# Readers ask for whole levels (every rank of the run), a prefix of the new keys.


def _rekey(table: str, columns_ddl: str, key: str) -> list[str]:
    """Rebuild ``table`` (WITHOUT ROWID) under a new primary key, keeping its rows
    (``columns_ddl`` lists the columns in the table's order: rows copy by position)."""
    return [
        f"CREATE TABLE {table}_rekeyed ({columns_ddl}, PRIMARY KEY ({key})) WITHOUT ROWID",
        f"INSERT INTO {table}_rekeyed SELECT * FROM {table}",
        f"DROP TABLE {table}",
        f"ALTER TABLE {table}_rekeyed RENAME TO {table}",
    ]


def _v3() -> list[str]:
    metrics = _metric_columns()
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
        # every flush of every rank appended one (4096 rows a second at 4096 ranks),
        # each into the rank's own page of a (rank_id, ts) index. One row per rank now,
        # replaced on every flush: a replaced row gets a new, higher rowid, so readers
        # that tail ``rowid > last`` still see every change.
        "DELETE FROM status WHERE rowid NOT IN (SELECT (SELECT x.rowid FROM status x WHERE x.rank_id = r.rank_id "
        "ORDER BY x.ts DESC, x.rowid DESC LIMIT 1) FROM (SELECT DISTINCT rank_id FROM status) r)",
        "DROP INDEX IF EXISTS status_by_rank",
        "CREATE UNIQUE INDEX status_one_per_rank ON status (rank_id)",
    ]


# ------------------------------------------- v4: per-rank indexes keyed by rank group
# Every flush of every rank appended to that rank's own tail of each per-rank index
# (rank_id, step): once the tails sat on pages of their own (~40 s into a 4096-rank
# run) each commit dirtied a page per rank and index, whole 4 KiB pages written to
# the WAL and copied again at checkpoint for ~100 bytes of entries each: 66% of the
# WAL's frames were steps_by_rank, 14% process_by_rank, 9% gpu_by_rank
# (bench/walpages.py), ~100 MB/s of disk writes for ~4 MB/s of rows, and the hot
# set (~2 pages per rank per index) outgrew the page cache, so the daemon's CPU
# climbed through the run. Keyed (rank_id / RANK_GROUP, ..., rank_id), the ranks of
# a group share one tail: a commit dirties a page per group. Reads of one rank walk
# its group's entries (RANK_GROUP x as many, index only, filtered on rank_id before
# any row is fetched); ``rank_is`` writes the terms that let SQLite use the index.

RANK_GROUP = 8

# Table -> the columns its per-rank reads order by (after the group, before rank_id).
GROUPED_INDEXES = {
    "steps": "step",
    "scalars": "name, step",
    "process": "ts",
    "system": "ts",
    "gpu": "ts",
    "spans": "start_ns",
    "layers": "step",
}


def rank_is(value: str, column: str = "rank_id") -> str:
    """SQL terms selecting one rank's rows through its ``{table}_by_group`` index.

    ``value`` is an SQL expression: ``"?1"`` (a numbered parameter, used twice) or
    another table's column (``"r.rank_id"``). Both terms are needed: the group term is
    what the index is searched by, and the unary ``+`` keeps SQLite from substituting
    a constant ``value`` for ``column`` in it (constant propagation), which would turn
    the search into a scan of the whole table."""
    return f"{column} / {RANK_GROUP} = {value} / {RANK_GROUP} AND +{column} = {value}"


def ranks_in(count: int, column: str = "rank_id") -> str:
    """``rank_is`` for any of ``count`` ranks, given as parameters ?1 .. ?count."""
    marks = range(1, count + 1)
    groups = ", ".join(f"?{i} / {RANK_GROUP}" for i in marks)
    return f"{column} / {RANK_GROUP} IN ({groups}) AND +{column} IN ({', '.join(f'?{i}' for i in marks)})"


def _v4() -> list[str]:
    out: list[str] = []
    for table, order in GROUPED_INDEXES.items():
        out += [
            f"DROP INDEX IF EXISTS {table}_by_rank",
            f"CREATE INDEX {table}_by_group ON {table} (rank_id / {RANK_GROUP}, {order}, rank_id)",
        ]
    return out


# ------------------------------------------- v5: a reservoir size per rank
# A rank's sample holds RESERVOIR_SIZE points, or fewer in a big job (see
# IngestPolicy.reservoir_size_for), so the reservoir table stays bounded whatever
# the number of ranks. Each rank keeps the size it started with: Algorithm L's state
# (seen, next_take, w) is only meaningful for one size. Ranks sampled before v5 keep
# the size they had.


def _v5() -> list[str]:
    return [f"ALTER TABLE reservoir_state ADD COLUMN size INTEGER NOT NULL DEFAULT {RESERVOIR_SIZE}"]


# ------------------------------------------- v6: ranks' identity columns from the declaration
# ``ranks`` holds, per agent sender, its identity: one column per field of
# traceml_wire.identity.IDENTITY, under the field's name, between the sender and the
# daemon's own bookkeeping. v1 wrote them out by hand, with the agent's run id twice
# ("session" from parsing the sender id, "run_id" from the hello); the daemon now
# reads identity from the hello alone, under one name, so v6 rebuilds the table from
# the declaration and run_id goes. Rank ids are kept: every other table points at them.

RANK_COLUMNS: tuple[str, ...] = ("rank_id", "sender", *IDENTITY_NAMES, "first_seen", "last_seen", "last_seq")

# How many of IDENTITY's fields v6 creates. Fields are only appended; each one after
# these gets a step of its own, ``ALTER TABLE ranks ADD COLUMN {identity_column_ddl(spec)}``,
# so that fresh and migrated databases end with the same columns
# (tests/traceml_daemon/ingest/test_identity_columns.py checks they are RANK_COLUMNS).
_V6_IDENTITY_FIELDS = 12


def _sql_literal(value: int | str) -> str:
    return str(value) if isinstance(value, int) else "'" + value.replace("'", "''") + "'"


def identity_column_ddl(spec: IdentityField) -> str:
    """A ranks column for one declared field: NULL where no channel stated it, unless
    the field has a default (the keys readers select runs by are never NULL)."""
    ddl = f"{spec.name} {_SQL_TYPES[spec.kind]}"
    return ddl if spec.default is None else f"{ddl} NOT NULL DEFAULT {_sql_literal(spec.default)}"


def _ranks_ddl(table: str, identity: tuple[IdentityField, ...]) -> str:
    cols = ", ".join(identity_column_ddl(spec) for spec in identity)
    return (
        f"CREATE TABLE {table} (rank_id INTEGER PRIMARY KEY, sender TEXT NOT NULL UNIQUE, {cols}, "
        "first_seen REAL, last_seen REAL, last_seq INTEGER NOT NULL DEFAULT 0)"  # last_seq: dedup mark
    )


def _v6() -> list[str]:
    identity = IDENTITY[:_V6_IDENTITY_FIELDS]
    cols = ", ".join(("rank_id", "sender", *(spec.name for spec in identity), "first_seen", "last_seen", "last_seq"))
    return [
        _ranks_ddl("ranks_v6", identity),
        f"INSERT INTO ranks_v6 ({cols}) SELECT {cols} FROM ranks",
        "DROP TABLE ranks",  # drops ranks_by_node with it
        "ALTER TABLE ranks_v6 RENAME TO ranks",
        "CREATE INDEX ranks_by_node ON ranks (session, attempt, node_rank, global_rank)",
    ]


# ------------------------------------------- v7: quarantine, and non-finite scalars found cheaply
# A batch that cannot be stored (it fails validation, or a transaction holding it
# fails and it fails again alone) is set aside here with its sender, seq and the
# reason, so the daemon acknowledges it and goes on instead of retrying it into a
# crash (traceml_daemon/ingest/quarantine.py). Only text the daemon cut short and
# bytes: nothing in a row can fail to store for the data it describes. ``seq`` is
# text because a refused seq may not fit an INTEGER.
#
# SQLite stores a NaN REAL as NULL, so a scalar that went NaN is stored as the text
# 'NaN' (float('NaN') reads it back); infinities are REALs as they are. Readers
# find a run's non-finite scalars through this partial index, which holds only
# those rows, by repeating its WHERE expression, ``NONFINITE_SCALAR``.

# delivery.source: the daemon's own counters, an agent's drop counters ("agent:" + sender),
# a relay's stats ("relay:" + relay sender).
DAEMON_SOURCE = "daemon"
AGENT_PREFIX = "agent:"
RELAY_PREFIX = "relay:"

NONFINITE_SCALAR = "value = 'NaN' OR value IN (9e999, -9e999)"


def _v7() -> list[str]:
    return [
        "CREATE TABLE quarantine (id INTEGER PRIMARY KEY, ts REAL NOT NULL, relay TEXT, sender TEXT, seq TEXT, "
        "reason TEXT NOT NULL, body BLOB, body_bytes INTEGER NOT NULL DEFAULT 0)",
        f"CREATE INDEX scalars_nonfinite ON scalars (rank_id, name, step) WHERE {NONFINITE_SCALAR}",
    ]


# ------------------------------------------- v8: rank output
# Each rank's stdout and stderr lines (wire table "output"), read per rank in time
# order (``traceml-daemon logs``, the step inspector), grouped like the other tables.


def _v8() -> list[str]:
    return [
        telemetry_table_ddl("output"),
        f"CREATE INDEX IF NOT EXISTS output_by_group ON output (rank_id / {RANK_GROUP}, ts, rank_id)",
    ]


# ------------------------------------------- v9: span lanes, rollout sessions, profiles
# spans gain category, lane (thread or asyncio task), span_id and parent_id. The table
# is rebuilt rather than altered: MIGRATIONS[0] makes today's wire tables, so a fresh
# database already has the new columns and an ALTER would fail there. New tables: the
# rollout session records and their phase executions (read per session of a run), and
# the torch.profiler trace files ranks wrote.

_V9_SPANS_OLD = "name, start_ns, dur_ns, step, args"


def _v9() -> list[str]:
    return [
        telemetry_table_ddl("spans").replace("CREATE TABLE IF NOT EXISTS spans", "CREATE TABLE spans_v9"),
        f"INSERT INTO spans_v9 (rank_id, {_V9_SPANS_OLD}) SELECT rank_id, {_V9_SPANS_OLD} FROM spans",
        "DROP TABLE spans",
        "ALTER TABLE spans_v9 RENAME TO spans",
        f"CREATE INDEX spans_by_group ON spans (rank_id / {RANK_GROUP}, start_ns, rank_id)",
        telemetry_table_ddl("rollout_sessions"),
        f"CREATE INDEX IF NOT EXISTS rollout_sessions_by_group ON rollout_sessions "
        f"(rank_id / {RANK_GROUP}, session_id, rank_id)",
        telemetry_table_ddl("session_phases"),
        f"CREATE INDEX IF NOT EXISTS session_phases_by_group ON session_phases "
        f"(rank_id / {RANK_GROUP}, session_id, rank_id)",
        telemetry_table_ddl("profiles"),
        "CREATE INDEX IF NOT EXISTS profiles_by_rank ON profiles (rank_id, step)",
    ]


# ------------------------------------------- v10: FSDP2 collective wait and mesh
# steps gain the FSDP2 collective time measured inside forward and backward, its part on
# HSDP's replicate dimension and the device memory after forward; models the mesh's
# shard and replicate sizes (LATER_COLUMNS). Rebuilt, not altered: MIGRATIONS[0] makes
# today's wire tables, so a fresh database already has the columns and an ALTER would
# fail there. Rows keep their rowids (readers tail steps by rowid); old rows read NULL,
# not measured. The tables are written out, so this step stays what it was.

_V10_TABLES = {
    "steps": ("step INTEGER, ts REAL, step_ns INTEGER, dataloader_ns INTEGER, h2d_ns INTEGER, forward_ns INTEGER, "
              "backward_ns INTEGER, optimizer_ns INTEGER, wait_ns INTEGER, comm_ns INTEGER, peak_bytes INTEGER, "
              "reserved_bytes INTEGER, rss_bytes INTEGER, model_id INTEGER",
              "fwd_comm_ns INTEGER, bwd_comm_ns INTEGER, replicate_comm_ns INTEGER, post_forward_bytes INTEGER"),
    "models": ("model_id INTEGER, name TEXT, parallelism TEXT, n_modules INTEGER, param_bytes INTEGER, "
               "local_shard_bytes INTEGER, estimated_full_bytes INTEGER",
               "shard_degree INTEGER, replicate_degree INTEGER"),
}


def _v10() -> list[str]:
    out: list[str] = []
    for table, (old, new) in _V10_TABLES.items():
        kept = "rowid, rank_id, " + ", ".join(col.split()[0] for col in old.split(", "))
        out += [
            f"CREATE TABLE {table}_v10 (rank_id INTEGER NOT NULL, {old}, {new})",
            f"INSERT INTO {table}_v10 ({kept}) SELECT {kept} FROM {table}",
            f"DROP TABLE {table}",  # drops its index with it
            f"ALTER TABLE {table}_v10 RENAME TO {table}",
        ]
    return out + [
        f"CREATE INDEX steps_by_group ON steps (rank_id / {RANK_GROUP}, {GROUPED_INDEXES['steps']}, rank_id)",
        "CREATE INDEX models_by_rank ON models (rank_id, model_id)",
    ]


# ------------------------------------------- v11: numerics fingerprints
# Per parameter tensor every N steps (agent/fingerprint.py): norms and the gradient's
# non-finite count. Read per run (verdicts, compare) by step. Written out rather than
# from the wire declaration, so this step stays what it was. IF NOT EXISTS: a fresh
# database already has it from MIGRATIONS[0].


def _v11() -> list[str]:
    return [
        "CREATE TABLE IF NOT EXISTS fingerprints (rank_id INTEGER NOT NULL, step INTEGER, model_id INTEGER, "
        "idx INTEGER, layer TEXT, param_norm REAL, grad_norm REAL, grad_nonfinite INTEGER, shard INTEGER)",
        f"CREATE INDEX IF NOT EXISTS fingerprints_by_group ON fingerprints (rank_id / {RANK_GROUP}, step, rank_id)",
    ]


# ------------------------------------------- v12: fingerprints' bit sums
# fingerprints gains param_sum: the parameter's bits summed as wrapping int32, the exact
# equality witness replicas and runs are compared on (a float norm can round a one-ULP
# change away). Rebuilt, not altered, as v10: a fresh database already has the column.
# Old rows read NULL, not taken.

_V12_OLD = "step, model_id, idx, layer, param_norm, grad_norm, grad_nonfinite, shard"


def _v12() -> list[str]:
    return [
        "CREATE TABLE fingerprints_v12 (rank_id INTEGER NOT NULL, step INTEGER, model_id INTEGER, idx INTEGER, "
        "layer TEXT, param_norm REAL, grad_norm REAL, grad_nonfinite INTEGER, shard INTEGER, param_sum INTEGER)",
        f"INSERT INTO fingerprints_v12 (rowid, rank_id, {_V12_OLD}) SELECT rowid, rank_id, {_V12_OLD} FROM fingerprints",
        "DROP TABLE fingerprints",
        "ALTER TABLE fingerprints_v12 RENAME TO fingerprints",
        f"CREATE INDEX fingerprints_by_group ON fingerprints (rank_id / {RANK_GROUP}, step, rank_id)",
    ]


# ------------------------------------------- v13: which steps carry device timing
# steps gain device_timed (agent/device_sampling.py): 1 timed on the device, 0 a GPU step
# timed on the host only, NULL on CPU and in older rows. Rebuilt, not altered, as v10.

_V13_STEPS = (_V10_TABLES["steps"][0] + ", " + _V10_TABLES["steps"][1])


def _v13() -> list[str]:
    kept = "rowid, rank_id, " + ", ".join(col.split()[0] for col in _V13_STEPS.split(", "))
    return [
        f"CREATE TABLE steps_v13 (rank_id INTEGER NOT NULL, {_V13_STEPS}, device_timed INTEGER)",
        f"INSERT INTO steps_v13 ({kept}) SELECT {kept} FROM steps",
        "DROP TABLE steps",  # drops its indexes with it
        "ALTER TABLE steps_v13 RENAME TO steps",
        f"CREATE INDEX steps_by_group ON steps (rank_id / {RANK_GROUP}, {GROUPED_INDEXES['steps']}, rank_id)",
    ]


# MIGRATIONS[i] brings a database from version i to i + 1.
MIGRATIONS: list[list[str]] = [_v1(), _v2(), _v3(), _v4(), _v5(), _v6(), _v7(), _v8(), _v9(), _v10(), _v11(), _v12(),
                               _v13()]

PRAGMAS = [
    "PRAGMA journal_mode=WAL",
    "PRAGMA synchronous=NORMAL",
    "PRAGMA temp_store=MEMORY",
]
