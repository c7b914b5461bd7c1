"""Staging: queued batches turned into one transaction's plan and statements.

``stage`` decodes a transaction's work items (``Ingestor``: dedup, rank ids,
identity) into a ``Plan`` and the statements that write it: multi-row INSERTs per
telemetry table (built later, on the database thread), the ranks upsert, and a
narrow ranks update for senders whose identity is already committed (rank id,
last seen, last seq: all the dedup mark needs), and the rows of the batches set
aside (``ingest/quarantine.py``). ``with_counters`` adds the delivery counters
at hand-over time. Pure CPU, the event loop's share.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from traceml_daemon.ingest import quarantine
from traceml_daemon.ingest.counters import AGENT_PREFIX, DAEMON_SOURCE, RELAY_PREFIX
from traceml_daemon.ingest.decode import RANK_COLUMNS, TABLE_COLUMNS, Ingestor, Plan
from traceml_daemon.store.statements import SqlParts, Statement, chunk_statements, multi_row_tuples
from traceml_wire.tables import Column, columns


@dataclass
class WorkItem:
    """One batch as the writer sees it; ``done(ok)`` runs after commit (ack) or failure."""

    relay_sender: str
    session: str | None
    seq: int
    items: list[list[Any]]
    peers: dict[str, dict[str, Any]]
    node: dict[str, Any]
    stats: dict[str, int]
    done: Callable[[bool], None] | None = None
    # False once the batch's connection has failed: it is dropped unstored (see stage).
    live: Callable[[], bool] | None = None


@dataclass
class Staged:
    """One transaction, ready to write: the plan and its statements (rows and ranks;
    counters and any due history are added at write time)."""

    work: list[WorkItem]
    taken_bytes: int
    plan: Plan
    statements: list[Statement]
    # Per telemetry table, what builds its INSERTs from the plan's decoded batches: run
    # on the database thread inside the transaction, so the event loop goes on to
    # stage the next transaction instead of flattening rows.
    tables: list[Callable[[], list[Statement]]] = field(default_factory=list)
    # Set when staging ``work`` failed as a whole (nothing of it is in ``plan``): the
    # writer then writes its items apart (ingest/recovery.py).
    error: Exception | None = None


# Tables holding one row per rank (schema v3): a new row replaces the rank's last.
LATEST_ONLY_TABLES = frozenset({"status"})

_IDENTITY_UPDATE = ", ".join(
    f"{col}=coalesce(excluded.{col}, {col})"
    for col in RANK_COLUMNS
    if col not in ("rank_id", "sender", "session", "attempt", "first_seen", "last_seen", "last_seq")
)
_RANK_CONFLICT = (
    f"ON CONFLICT(sender) DO UPDATE SET last_seen=excluded.last_seen, "
    f"last_seq=max(last_seq, excluded.last_seq), {_IDENTITY_UPDATE}"
)


def _table_parts(table: str) -> SqlParts:
    cols = ("rank_id", *columns(table))
    verb = "INSERT OR REPLACE" if table in LATEST_ONLY_TABLES else "INSERT"
    return f"{verb} INTO {table} ({', '.join(cols)})", "", len(cols)


_TABLE_PARTS = {name: _table_parts(name) for name in TABLE_COLUMNS}
_RANK_PARTS: SqlParts = (f"INSERT INTO ranks ({', '.join(RANK_COLUMNS)})", _RANK_CONFLICT, len(RANK_COLUMNS))
# Senders whose full ranks row is already committed: only the dedup mark and
# last_seen change, and a 3-column UPDATE ... FROM (VALUES ...) costs a fraction
# of the full upsert with its coalesce per identity column.
_RANK_TOUCH_PARTS: SqlParts = (
    "UPDATE ranks SET last_seen=v.column2, last_seq=max(ranks.last_seq, v.column3) FROM (",
    ") AS v WHERE ranks.rank_id=v.column1",
    3,
)
_MONOTONIC_PARTS: SqlParts = (
    "INSERT INTO delivery(source, counter, value)",
    "ON CONFLICT(source, counter) DO UPDATE SET value=max(value, excluded.value)",
    3,
)
_EXACT_PARTS: SqlParts = (
    "INSERT INTO delivery(source, counter, value)",
    "ON CONFLICT(source, counter) DO UPDATE SET value=excluded.value",
    3,
)

# The daemon counters a plan adds to, each a Plan field of the same name (the rest are
# counted live by the server).
PLAN_COUNTERS = (
    "rows_stored",
    "duplicates_discarded",
    "bad_bodies",
    "partials_refused",
    "batches_quarantined",
    "seq_jumps_refused",
    "stats_refused",
    "durations_nulled",
    "senders_without_identity",
    "identity_fields_refused",
)


def plan_adds(plan: Plan) -> list[int]:
    """What ``plan`` adds to each of ``PLAN_COUNTERS``."""
    return [getattr(plan, name) for name in PLAN_COUNTERS]


def _table_statements(table: str, chunks: list[tuple[int, list[Column]]]) -> list[Statement]:
    return chunk_statements(_TABLE_PARTS[table], chunks)


def live_only(work: list[WorkItem]) -> list[WorkItem]:
    """``work`` less the batches whose connection has failed since they were queued:
    those are dropped here, not acknowledged, and their relay resends them, after the
    failed one, on a new connection."""
    kept: list[WorkItem] = []
    for item in work:
        if item.live is None or item.live():
            kept.append(item)
        elif item.done is not None:
            item.done(False)
    return kept


def stage(ingestor: Ingestor, work: list[WorkItem], taken_bytes: int = 0) -> Staged:
    """Decode ``work`` into one transaction against ``ingestor``'s dedup marks
    (after ``live_only``)."""
    return stage_live(ingestor, live_only(work), taken_bytes)


def stage_live(ingestor: Ingestor, work: list[WorkItem], taken_bytes: int = 0) -> Staged:
    """``stage`` for work whose dead connections were dropped already."""
    plan = Plan(epoch=ingestor.epoch)
    try:
        return _stage_into(plan, ingestor, work, taken_bytes)
    except Exception:
        ingestor.discard(plan)
        raise


def _stage_into(plan: Plan, ingestor: Ingestor, work: list[WorkItem], taken_bytes: int) -> Staged:
    now = time.time()
    for item in work:
        ingestor.stage(
            plan,
            relay_sender=item.relay_sender,
            session=item.session,
            items=item.items,
            peers=item.peers,
            node=item.node,
            stats=item.stats,
            now=now,
        )
    ingestor.staged(plan)
    statements: list[Statement] = []
    if plan.ranks:
        statements += multi_row_tuples(_RANK_PARTS, plan.ranks.values())
    if plan.rank_touches:
        statements += multi_row_tuples(_RANK_TOUCH_PARTS, plan.rank_touches)
    if plan.quarantined:
        statements += quarantine.statements(plan.quarantined, now)
    tables = [functools.partial(_table_statements, table, chunks) for table, chunks in plan.chunks.items()]
    return Staged(work, taken_bytes, plan, statements, tables)


def with_counters(staged: Staged, counters: dict[str, int]) -> list[Statement]:
    """``staged``'s statements, then the delivery counters: the relays' and agents'
    (never lowered) from its plan, and the daemon's ``counters`` as they are."""
    plan = staged.plan
    monotonic = [
        (RELAY_PREFIX + relay, name, value) for relay, stats in plan.relay_stats.items() for name, value in stats.items()
    ]
    monotonic += [
        (AGENT_PREFIX + agent, name, value) for agent, drops in plan.agent_drops.items() for name, value in drops.items()
    ]
    statements = list(staged.statements)
    if monotonic:
        statements += multi_row_tuples(_MONOTONIC_PARTS, monotonic)
    statements += multi_row_tuples(_EXACT_PARTS, [(DAEMON_SOURCE, k, v) for k, v in counters.items()])
    return statements
