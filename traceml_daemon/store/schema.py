"""The SQLite schema as it stands: typed columns per table, mirrored from the wire tables.

Every telemetry table is the wire table of the same name plus ``rank_id``,
the integer key of the sending rank in ``ranks``. Column types follow
``traceml_wire.tables.TABLES``. The steps that build it, version by version, are
in store/migrations/: bump ``SCHEMA_VERSION`` and add a step there for every
change; never edit a released step. This module imports nothing from them.
"""

from __future__ import annotations

from traceml_wire.identity import IDENTITY_NAMES, IdentityField
from traceml_wire.partials import FINE_STEPS, METRICS
from traceml_wire.tables import INT, REAL, TABLES, TEXT

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


# ---------------------------------------------------------------- history (v2)
# Downsampled history, maintained by the writer as steps arrive (store/history.py),
# so an overview of a run of any length reads O(width) rows per series and
# survives retention deleting raw steps.

# Steps per bucket, finest first; agents send partials of the finest level
# (traceml_wire/partials.py), so it is theirs to state.
HISTORY_LEVELS = (FINE_STEPS, 1024, 16384)
HISTORY_METRICS = METRICS  # step and every phase: each is the ``{metric}_ns`` column of steps
RESERVOIR_SIZE = 256  # most raw steps sampled per rank (+ the latest point); see v5
LATEST_SLOT = -1  # reservoir slot that always holds the rank's newest step


# ------------------------------------------- per-rank indexes keyed by rank group (v4)
# Every flush of every rank appended to that rank's own tail of each per-rank index
# (rank_id, step): once the tails sat on pages of their own each commit dirtied a
# page per rank and index, whole 4 KiB pages written to the WAL and copied again at
# checkpoint for ~100 bytes of entries each (bench/walpages.py names the pages), and
# the hot set (~2 pages per rank per index) outgrew the page cache, so the daemon's
# CPU climbed through the run. Keyed (rank_id / RANK_GROUP, ..., rank_id), the ranks
# of a group share one tail: a commit dirties a page per group. Reads of one rank walk
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


# ------------------------------------------- ranks' identity columns (v6)
# ``ranks`` holds, per agent sender, its identity: one column per field of
# traceml_wire.identity.IDENTITY, under the field's name, between the sender and the
# daemon's own bookkeeping. Rank ids are the key every other table points at.

RANK_COLUMNS: tuple[str, ...] = ("rank_id", "sender", *IDENTITY_NAMES, "first_seen", "last_seen", "last_seq")


def _sql_literal(value: int | str) -> str:
    return str(value) if isinstance(value, int) else "'" + value.replace("'", "''") + "'"


def identity_column_ddl(spec: IdentityField) -> str:
    """A ranks column for one declared field: NULL where no channel stated it, unless
    the field has a default (the keys readers select runs by are never NULL)."""
    ddl = f"{spec.name} {_SQL_TYPES[spec.kind]}"
    return ddl if spec.default is None else f"{ddl} NOT NULL DEFAULT {_sql_literal(spec.default)}"


# ------------------------------------------- delivery sources, non-finite scalars (v7)
# delivery.source: the daemon's own counters, an agent's drop counters ("agent:" + sender),
# a relay's stats ("relay:" + relay sender).
DAEMON_SOURCE = "daemon"
AGENT_PREFIX = "agent:"
RELAY_PREFIX = "relay:"

# SQLite stores a NaN REAL as NULL, so a scalar that went NaN is stored as the text
# 'NaN' (float('NaN') reads it back); infinities are REALs as they are. Readers
# find a run's non-finite scalars through the partial index scalars_nonfinite, which
# holds only those rows, by repeating its WHERE expression.
NONFINITE_SCALAR = "value = 'NaN' OR value IN (9e999, -9e999)"

PRAGMAS = [
    "PRAGMA journal_mode=WAL",
    "PRAGMA synchronous=NORMAL",
    "PRAGMA temp_store=MEMORY",
]
