"""User spans (``agent.span()`` regions) and instants (``agent.instant()`` marks, no duration)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from typing import Any

from traceml_daemon.store.schema import rank_is, ranks_in


def rank_spans(conn: sqlite3.Connection, rank_id: int) -> Iterator[tuple[Any, ...]]:
    """(name, start_ns, dur_ns, step, args, category, lane) of every span of a rank, by start
    time; ``args`` is the JSON text the agent sent. A database from before schema v9 (opened
    read-only, not migrated) has no category or lane: None."""
    try:
        return conn.execute(
            f"SELECT name, start_ns, dur_ns, step, args, category, lane FROM spans WHERE {rank_is('?1')} "
            "ORDER BY start_ns", (rank_id,)
        )
    except sqlite3.OperationalError:
        return conn.execute(
            f"SELECT name, start_ns, dur_ns, step, args, NULL, NULL FROM spans WHERE {rank_is('?1')} "
            "ORDER BY start_ns", (rank_id,)
        )


def earliest_span_start_ns(conn: sqlite3.Connection, rank_ids: list[int]) -> int | None:
    if not rank_ids:
        return None
    row = conn.execute(f"SELECT MIN(start_ns) FROM spans WHERE {ranks_in(len(rank_ids))}", rank_ids).fetchone()
    return None if row is None or row[0] is None else row[0]
