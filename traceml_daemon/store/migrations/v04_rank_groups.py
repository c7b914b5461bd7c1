"""v4: the per-rank indexes keyed by rank group, ``{table}_by_group``.

Why, and how reads use them: ``RANK_GROUP`` and ``rank_is`` in store/schema.py."""

from __future__ import annotations

from traceml_daemon.store.schema import GROUPED_INDEXES, RANK_GROUP


def statements() -> list[str]:
    out: list[str] = []
    for table, order in GROUPED_INDEXES.items():
        out += [
            f"DROP INDEX IF EXISTS {table}_by_rank",
            f"CREATE INDEX {table}_by_group ON {table} (rank_id / {RANK_GROUP}, {order}, rank_id)",
        ]
    return out
