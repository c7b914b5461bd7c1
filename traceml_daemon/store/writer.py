"""The single writer: drains the inbound queue into large SQLite transactions.

One task, one aiosqlite connection (its own thread), so the event loop never
blocks on disk and there is never write contention. Each transaction holds
every queued batch (up to ``max_txn_bytes``): rows go in with one executemany
per table, ranks and their dedup high-water marks are upserted, counters are
stored, and only after COMMIT are the senders acknowledged.

Two things keep a 2-core machine fed:

* Pipelining: transaction N+1 is staged (bodies decoded, rows and history
  deltas built) in the event loop while N runs on aiosqlite's thread.
* Few GIL hand-offs: Python's sqlite3 releases the GIL around every
  ``sqlite3_step``; with one step per row, the writer thread waits for the
  GIL (up to the switch interval) after every row whenever the event loop is
  busy, which cut throughput 4x. Rows therefore go in as multi-row
  ``INSERT ... VALUES (...), (...)`` statements of ``ROWS_PER_STATEMENT``
  rows (one step each), and the switch interval is lowered to 1 ms.

History (``store/history.py``) is folded into the same transaction as the
rows it summarises, and retention (``store/retention.py``) runs between
transactions in small chunks of its own.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import Any

import aiosqlite

from traceml_daemon.aggregates import Aggregates
from traceml_daemon.counters import AGENT_PREFIX, DAEMON_SOURCE, RELAY_PREFIX, Counters
from traceml_daemon.inbound import ByteQueue
from traceml_daemon.ingest import RANK_COLUMNS, Ingestor, Plan, RankState
from traceml_daemon.store import history
from traceml_daemon.store.migrate import migrate
from traceml_daemon.store.retention import RetentionPolicy, enforce
from traceml_daemon.store.schema import PRAGMAS
from traceml_wire.tables import columns

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


# sqlite >= 3.32 allows 32766 bound parameters per statement.
MAX_PARAMS = 32_000
ROWS_PER_STATEMENT = 256
GIL_SWITCH_INTERVAL = 0.001


def multi_insert_sql(table: str, nrows: int) -> str:
    cols = ("rank_id", *columns(table))
    one = f"({', '.join('?' * len(cols))})"
    return f"INSERT INTO {table} ({', '.join(cols)}) VALUES {', '.join([one] * nrows)}"


def chunked_params(table: str, rows: list[tuple[Any, ...]]) -> list[tuple[str, list[tuple[Any, ...]]]]:
    """(sql, parameter sets) pairs inserting ``rows``: full chunks of one statement
    shape, then the rest in power-of-two pieces so few statement shapes exist."""
    width = len(columns(table)) + 1
    per = max(1, min(ROWS_PER_STATEMENT, MAX_PARAMS // width))
    out: list[tuple[str, list[tuple[Any, ...]]]] = []
    full = len(rows) // per
    if full:
        out.append(
            (multi_insert_sql(table, per), [tuple(chain.from_iterable(rows[i * per : (i + 1) * per])) for i in range(full)])
        )
    at = full * per
    size = per
    while at < len(rows):
        while size > len(rows) - at:
            size //= 2
        out.append((multi_insert_sql(table, size), [tuple(chain.from_iterable(rows[at : at + size]))]))
        at += size
    return out


@dataclass
class Staged:
    """One transaction, ready to write: the plan and what history adds."""

    work: list[WorkItem]
    taken_bytes: int
    plan: Plan
    rank_hist: list[tuple[Any, ...]]
    node_hist: list[tuple[Any, ...]]
    reservoir: history.ReservoirUpdate


class StoreWriter:
    def __init__(
        self,
        path: str,
        counters: Counters | None = None,
        aggregates: Aggregates | None = None,
        *,
        max_txn_bytes: int = 32 * 1024 * 1024,
        flush_interval: float = 0.25,
        retention: RetentionPolicy | None = None,
        tune_gil: bool = True,
    ) -> None:
        self.path = path
        self.counters = counters or Counters()
        self.aggregates = aggregates
        self.max_txn_bytes = max_txn_bytes
        self.flush_interval = flush_interval
        self.retention = retention
        self.tune_gil = tune_gil
        self.ingestor = Ingestor()
        self.reservoir = history.Reservoir()
        self._db: aiosqlite.Connection | None = None
        self._stored_counters: dict[str, int] = {}
        self._next_retention = 0.0
        # Test hook: awaited before every transaction (a test can stall the writer with it).
        self.before_write: Callable[[], Any] | None = None

    async def open(self) -> None:
        await asyncio.to_thread(migrate, self.path)
        if self.tune_gil:
            # Process-wide, and deliberate: the daemon's writer thread must get the GIL
            # back quickly after each sqlite3_step (see the module docstring).
            sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL))
        self._db = await aiosqlite.connect(self.path, isolation_level=None)
        for pragma in PRAGMAS:
            await self._db.execute(pragma)
        known: dict[str, RankState] = {}
        top = 0
        async with self._db.execute(
            "SELECT sender, rank_id, last_seq, global_rank, node_rank, session, attempt FROM ranks"
        ) as cur:
            async for sender, rank_id, last_seq, global_rank, node_rank, session, attempt in cur:
                known[sender] = RankState(rank_id, last_seq, global_rank, node_rank, session, attempt)
                top = max(top, rank_id)
        self.ingestor = Ingestor(known, next_rank_id=top + 1)
        async with self._db.execute("SELECT rank_id, seen, next_take, w FROM reservoir_state") as cur:
            self.reservoir.load([tuple(row) async for row in cur])  # type: ignore[misc]
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
        """Drain ``queue`` until it is closed and empty.

        Stage the next transaction while the previous one is written: decoding
        runs in the event loop, sqlite on aiosqlite's thread, so they overlap.
        """
        writing: asyncio.Task[bool] | None = None
        previous: Staged | None = None
        while True:
            taken = await queue.get_many(self.max_txn_bytes, self.flush_interval)
            if not taken and queue.closed and len(queue) == 0:
                break
            staged = self.stage([item for item, _ in taken], sum(n for _, n in taken))
            if writing is not None and not await writing and previous is not None:
                # The previous transaction failed and rolled every pending mark back:
                # what was staged after it deduplicated against rows never stored.
                # Undo newest first, so each rank ends at its state before ``previous``.
                self.reservoir.rollback(staged.reservoir)
                self.reservoir.rollback(previous.reservoir)
                staged = self.stage(staged.work, staged.taken_bytes)
            previous = staged
            writing = asyncio.create_task(self._write_and_ack(staged, queue))
        if writing is not None:
            await writing

    async def _write_and_ack(self, staged: Staged, queue: ByteQueue[WorkItem]) -> bool:
        ok = False
        try:
            ok = await self.write_staged(staged)
        finally:
            await queue.release(staged.taken_bytes)
            for item in staged.work:
                if item.done is not None:
                    item.done(ok)
        if self.retention is not None and time.monotonic() >= self._next_retention:
            self._next_retention = time.monotonic() + self.retention.interval_s
            await self.enforce_retention()
        return ok

    async def enforce_retention(self) -> int:
        assert self._db is not None, "open() first"
        if self.retention is None:
            return 0
        try:
            return await enforce(self._db, self.retention, time.time())
        except sqlite3.Error as exc:
            log.error("retention failed: %s", exc)
            return 0

    def stage(self, work: list[WorkItem], taken_bytes: int = 0) -> Staged:
        """Decode ``work`` into one transaction (pure CPU, the event loop's share)."""
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
        self.ingestor.staged(plan)
        deltas = history.bucket_deltas(plan.steps_by_rank)
        states = {s.rank_id: s for s in (*self.ingestor.known.values(), *plan.high_water.values())}

        def node_of(rank_id: int) -> history.NodeKey | None:
            st = states.get(rank_id)
            if st is None or st.node_rank is None:
                return None
            return (st.session or "unknown", st.attempt, st.node_rank)

        nodes = history.node_deltas(deltas, node_of)
        update = history.ReservoirUpdate()
        for rank_id, cols in plan.steps_by_rank.items():
            self.reservoir.offer(rank_id, cols, update)
        return Staged(work, taken_bytes, plan, history.history_rows(deltas), history.history_rows(nodes), update)

    async def write(self, work: list[WorkItem]) -> bool:
        """Write ``work`` (possibly empty: counters only) in one transaction."""
        return await self.write_staged(self.stage(work))

    async def write_staged(self, staged: Staged) -> bool:
        assert self._db is not None, "open() first"
        if self.before_write is not None:
            await self.before_write()
        plan = staged.plan
        counters = self.counters.as_dict()
        counters["rows_stored"] += plan.rows_stored
        counters["duplicates_discarded"] += plan.duplicates_discarded
        counters["bad_bodies"] += plan.bad_bodies
        if plan.empty and counters == self._stored_counters:
            self.ingestor.commit(plan)
            return True
        db = self._db
        res_rows, res_states = history.reservoir_rows(staged.reservoir)
        try:
            await db.execute("BEGIN IMMEDIATE")
            if plan.ranks:
                await db.executemany(_UPSERT_RANK, list(plan.ranks.values()))
            for table, rows in plan.rows.items():
                for sql, params in chunked_params(table, rows):
                    await db.executemany(sql, params)
            if staged.rank_hist:
                await db.executemany(history.RANK_UPSERT, staged.rank_hist)
            if staged.node_hist:
                await db.executemany(history.NODE_UPSERT, staged.node_hist)
            if res_rows:
                await db.executemany(history.RESERVOIR_UPSERT, res_rows)
                await db.executemany(history.RESERVOIR_STATE_UPSERT, res_states)
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
            log.error("write of %d batches failed, not acknowledged: %s", len(staged.work), exc)
            try:
                await db.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            self.ingestor.rollback(plan)
            self.reservoir.rollback(staged.reservoir)
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
