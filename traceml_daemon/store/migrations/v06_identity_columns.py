"""v6: ranks' identity columns from the declaration.

``ranks`` holds, per agent sender, its identity: one column per field of
traceml_wire.identity.IDENTITY, under the field's name, between the sender and the
daemon's own bookkeeping. v1 wrote them out by hand, with the agent's run id twice
("session" from parsing the sender id, "run_id" from the hello); the daemon now
reads identity from the hello alone, under one name, so v6 rebuilds the table from
the declaration and run_id goes. Rank ids are kept: every other table points at them."""

from __future__ import annotations

from traceml_daemon.store.schema import identity_column_ddl
from traceml_wire.identity import IDENTITY, IdentityField

# How many of IDENTITY's fields v6 creates. Fields are only appended; each one after
# these gets a step of its own, ``ALTER TABLE ranks ADD COLUMN {identity_column_ddl(spec)}``,
# so that fresh and migrated databases end with the same columns
# (tests/traceml_daemon/ingest/test_identity_columns.py checks they are RANK_COLUMNS).
_V6_IDENTITY_FIELDS = 12


def _ranks_ddl(table: str, identity: tuple[IdentityField, ...]) -> str:
    cols = ", ".join(identity_column_ddl(spec) for spec in identity)
    return (
        f"CREATE TABLE {table} (rank_id INTEGER PRIMARY KEY, sender TEXT NOT NULL UNIQUE, {cols}, "
        "first_seen REAL, last_seen REAL, last_seq INTEGER NOT NULL DEFAULT 0)"  # last_seq: dedup mark
    )


def statements() -> list[str]:
    identity = IDENTITY[:_V6_IDENTITY_FIELDS]
    cols = ", ".join(("rank_id", "sender", *(spec.name for spec in identity), "first_seen", "last_seen", "last_seq"))
    return [
        _ranks_ddl("ranks_v6", identity),
        f"INSERT INTO ranks_v6 ({cols}) SELECT {cols} FROM ranks",
        "DROP TABLE ranks",  # drops ranks_by_node with it
        "ALTER TABLE ranks_v6 RENAME TO ranks",
        "CREATE INDEX ranks_by_node ON ranks (session, attempt, node_rank, global_rank)",
    ]
