"""The single writer: drains the inbound queue into large SQLite transactions.

One task, one aiosqlite connection (its own thread), so the event loop never
blocks on disk and there is never write contention. Each transaction holds
every queued batch (up to ``max_txn_bytes``): rows go in with one executemany
per table, ranks and their dedup high-water marks are upserted, counters are
stored, and only after COMMIT are the senders acknowledged.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiosqlite

from traceml_daemon.aggregates import Aggregates
from traceml_daemon.counters import AGENT_PREFIX, DAEMON_SOURCE, RELAY_PREFIX, Counters
from traceml_daemon.inbound import ByteQueue
from traceml_daemon.ingest import RANK_COLUMNS, Ingestor, Plan, RankState, insert_sql
from traceml_daemon.store.migrate import migrate
from traceml_daemon.store.schema import PRAGMAS

log = logging.getLogger("traceml_daemon.writer")


_IDENTITY_UPDATE = ", ".join(
    f"{col}=coalesce(excluded.{col}, {col})"
    for col in RANK_COLUMNS
    if col not in ("rank_id", "sender", "session", "attempt", "first_seen", "last_seen", "last_seq")
)
_UPSERT_RANK = (
    f"INSERT INTO ranks ({', '.join(RANK_COLUMNS)}) VALUES ({', '.join('?' * len(RANK_COLUMNS))}) "
    f"ON CONFLICT(sender) DO UPDATE SET last_seen=excluded.last_seen, "
    f"last_seq=max(last_seq, excluded.last_seq), {_IDENTITY_UPDATE}"
)
# Relay and agent counters are cumulative; a resent (older) rbatch must not lower them.
_UPSERT_MONOTONIC = (
    "INSERT INTO delivery(source, counter, value) VALUES(?, ?, ?) "
    "ON CONFLICT(source, counter) DO UPDATE SET value=max(value, excluded.value)"
)
_UPSERT_EXACT = (
    "INSERT INTO delivery(source, counter, value) VALUES(?, ?, ?) "
    "ON CONFLICT(source, counter) DO UPDATE SET value=excluded.value"
)


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


class StoreWriter:
    def __init__(
        self,
        path: str,
        counters: Counters | None = None,
        aggregates: Aggregates | None = None,
        *,
        max_txn_bytes: int = 32 * 1024 * 1024,
        flush_interval: float = 0.25,
    ) -> None:
        self.path = path
        self.counters = counters or Counters()
        self.aggregates = aggregates
        self.max_txn_bytes = max_txn_bytes
        self.flush_interval = flush_interval
        self.ingestor = Ingestor()
        self._db: aiosqlite.Connection | None = None
        self._stored_counters: dict[str, int] = {}

    async def open(self) -> None:
        await asyncio.to_thread(migrate, self.path)
        self._db = await aiosqlite.connect(self.path, isolation_level=None)
        for pragma in PRAGMAS:
            await self._db.execute(pragma)
        known: dict[str, RankState] = {}
        top = 0
        async with self._db.execute("SELECT sender, rank_id, last_seq, global_rank, node_rank FROM ranks") as cur:
            async for sender, rank_id, last_seq, global_rank, node_rank in cur:
                known[sender] = RankState(rank_id, last_seq, global_rank, node_rank)
                top = max(top, rank_id)
        self.ingestor = Ingestor(known, next_rank_id=top + 1)
        async with self._db.execute(
            "SELECT counter, value FROM delivery WHERE source=?", (DAEMON_SOURCE,)
        ) as cur:
            stored = {counter: value async for counter, value in cur}
        self.counters.load(stored)
        self._stored_counters = dict(stored)

    async def close(self) -> None:
        if self._db is not None:
            await self.write([])  # persist the final counters
            await self._db.close()
            self._db = None

    async def run(self, queue: ByteQueue[WorkItem]) -> None:
        """Drain ``queue`` until it is closed and empty."""
        while True:
            taken = await queue.get_many(self.max_txn_bytes, self.flush_interval)
            if not taken and queue.closed and len(queue) == 0:
                return
            work = [item for item, _ in taken]
            try:
                ok = await self.write(work)
            finally:
                await queue.release(sum(n for _, n in taken))
            for item in work:
                if item.done is not None:
                    item.done(ok)

    async def write(self, work: list[WorkItem]) -> bool:
        """Write ``work`` (possibly empty: counters only) in one transaction."""
        assert self._db is not None, "open() first"
        plan = Plan()
        now = time.time()
        for item in work:
            self.ingestor.stage(
                plan,
                relay_sender=item.relay_sender,
                session=item.session,
                items=item.items,
                peers=item.peers,
                node=item.node,
                stats=item.stats,
                now=now,
            )
        counters = self.counters.as_dict()
        counters["rows_stored"] += plan.rows_stored
        counters["duplicates_discarded"] += plan.duplicates_discarded
        counters["bad_bodies"] += plan.bad_bodies
        if plan.empty and counters == self._stored_counters:
            return True
        db = self._db
        try:
            await db.execute("BEGIN IMMEDIATE")
            if plan.ranks:
                await db.executemany(_UPSERT_RANK, list(plan.ranks.values()))
            for table, rows in plan.rows.items():
                await db.executemany(insert_sql(table), rows)
            monotonic = [
                (RELAY_PREFIX + relay, name, value) for relay, stats in plan.relay_stats.items() for name, value in stats.items()
            ]
            monotonic += [
                (AGENT_PREFIX + agent, name, value) for agent, drops in plan.agent_drops.items() for name, value in drops.items()
            ]
            if monotonic:
                await db.executemany(_UPSERT_MONOTONIC, monotonic)
            await db.executemany(_UPSERT_EXACT, [(DAEMON_SOURCE, k, v) for k, v in counters.items()])
            await db.execute("COMMIT")
        except (sqlite3.Error, OSError) as exc:
            log.error("write of %d batches failed, not acknowledged: %s", len(work), exc)
            try:
                await db.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            self.ingestor.rollback(plan)
            return False
        self.ingestor.commit(plan)
        self.counters.rows_stored = counters["rows_stored"]
        self.counters.duplicates_discarded = counters["duplicates_discarded"]
        self.counters.bad_bodies = counters["bad_bodies"]
        self._stored_counters = counters
        if self.aggregates is not None:
            by_id = {s.rank_id: s for s in plan.high_water.values()}
            for rank_id, cols in plan.steps_by_rank.items():
                state = by_id.get(rank_id)
                self.aggregates.add_steps(
                    rank_id,
                    cols,
                    global_rank=state.global_rank if state else None,
                    node_rank=state.node_rank if state else None,
                )
        return True
