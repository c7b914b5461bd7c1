"""The single writer: drains the inbound queue into large SQLite transactions.

One task, one aiosqlite connection (its own thread), so the event loop never
blocks on disk and there is never write contention. Each transaction holds every
queued batch (up to ``max_txn_bytes``), and only after its COMMIT are the senders
acknowledged. Transaction N+1 is staged (bodies decoded) in the event loop while
N runs on the database thread, and queued there behind N before N ends, so that
thread goes from one COMMIT straight to the next BEGIN while the event loop
acknowledges N (``StoreWriter.run``).

``StoreWriter`` is that loop and the bookkeeping around each transaction; each
other job has a module of its own:

* ``ingest/staging.py``: work items into a plan and its statements;
* ``ingest/transactions.py``: one transaction, whole, on the database thread;
* ``ingest/recovery.py``: a transaction that failed for its data, written apart,
  what fails alone set aside (``ingest/quarantine.py``) and every batch acknowledged;
* ``ingest/disk_full.py``: a transaction that failed with the disk full;
* ``store/statements.py``: rows as multi-row statements (few GIL hand-offs);
* ``ingest/history_feed.py``: committed steps folded into history, written when due;
* ``ingest/resume.py``: what ``open()`` reads back, and history's catch-up;
* ``store/retention.py``: when retention runs (between transactions) and what it deletes;
* ``ingest/hygiene.py``: GIL switch interval, timed garbage collection, heap trimming;
* ``store/checkpointer.py``: WAL checkpoints on a thread of their own.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import aiosqlite

from traceml_daemon.ingest import quarantine
from traceml_daemon.ingest.counters import Counters
from traceml_daemon.ingest.decode import Ingestor, Plan
from traceml_daemon.ingest.disk_full import DiskFull
from traceml_daemon.ingest.history_feed import HistoryFeed, HistoryHead
from traceml_daemon.ingest.hygiene import ProcessHygiene
from traceml_daemon.ingest.live import Aggregates
from traceml_daemon.ingest.quarantine import Quarantined, is_data_error
from traceml_daemon.ingest.recovery import Outcome, write_apart
from traceml_daemon.ingest.resume import catch_up_history, load_counters, load_ingestor, load_reservoir
from traceml_daemon.ingest.staging import (
    PLAN_COUNTERS,
    Staged,
    WorkItem,
    live_only,
    plan_adds,
    stage_live,
    with_counters,
)
from traceml_daemon.ingest.transactions import Chain, Skipped, run_chained, run_transaction
from traceml_daemon.net.inbound import ByteQueue
from traceml_daemon.store import wal_index
from traceml_daemon.store.checkpointer import Checkpointer
from traceml_daemon.store.db_thread import on_db_thread, require_private_api
from traceml_daemon.store.disk_full import is_disk_full
from traceml_daemon.store.migrate import migrate
from traceml_daemon.store.policy import DEFAULT_POLICY, IngestPolicy
from traceml_daemon.store.retention import RetentionPolicy, RetentionSchedule, make_room
from traceml_daemon.store.schema import PRAGMAS

__all__ = ["Staged", "StoreWriter", "WorkItem"]

log = logging.getLogger("traceml_daemon.writer")


@dataclass
class _Submitted:
    """A staged transaction handed to the database thread (``call`` None: nothing to write)."""

    staged: Staged
    head: HistoryHead | None
    counters: dict[str, int]
    call: asyncio.Future[Any] | None
    chain: Chain
    # Done once ``_finish`` has run (committed or not): the next one finishes after it.
    finished: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    # Set by ``_finish``: per work item, whether to acknowledge it; and whether every
    # one was stored or set aside (committed whole, or written apart to the end).
    acks: list[bool] | None = None
    settled: bool = False


class StoreWriter:
    def __init__(
        self,
        path: str,
        counters: Counters | None = None,
        aggregates: Aggregates | None = None,
        *,
        policy: IngestPolicy = DEFAULT_POLICY,
        retention: RetentionPolicy | None = None,
        drop_when_full: bool = False,
        tune_gil: bool = True,
        # Single-threshold overrides of ``policy`` (tests).
        max_txn_bytes: int | None = None,
        flush_interval: float | None = None,
        coalesce_s: float | None = None,
        history_interval: float | None = None,
    ) -> None:
        overrides = {
            "max_txn_bytes": max_txn_bytes,
            "flush_interval": flush_interval,
            "coalesce_s": coalesce_s,
            "history_interval": history_interval,
        }
        self.policy = replace(policy, **{k: v for k, v in overrides.items() if v is not None})
        self.path = path
        self.counters = counters or Counters()
        self.aggregates = aggregates
        self.max_txn_bytes = self.policy.max_txn_bytes
        self.flush_interval = self.policy.flush_interval
        self.coalesce_s = self.policy.coalesce_s
        # tune_gil: make the process-wide settings of ``hygiene`` from open() to close().
        self.tune_gil = tune_gil
        self.ingestor = Ingestor()
        self.history = HistoryFeed(self.policy, lambda: len(self.ingestor.known))
        self.retention = RetentionSchedule(retention)
        # drop_when_full (serve): what a full disk cannot hold is acknowledged and counted.
        self.disk_full = DiskFull(self.counters, drop_when_full)
        self.hygiene = ProcessHygiene(self.policy)
        self.checkpointer = Checkpointer(path, self.policy.checkpoint_interval_s, self.policy.wal_autocheckpoint_pages)
        self._db: aiosqlite.Connection | None = None
        # The counters of the last transaction handed to the database thread (None: store
        # them with the next one, whatever they are).
        self._stored_counters: dict[str, int] | None = {}
        # What handed-over transactions not yet committed add to the plan counters: the
        # next one stores the totals they will reach.
        self._uncommitted: dict[str, int] = dict.fromkeys(PLAN_COUNTERS, 0)
        self._in_flight = 0  # transactions handed to the database thread, not finished
        self._chain = Chain()
        # Test hook: awaited before every transaction (a test can stall the writer with it).
        self.before_write: Callable[[], Any] | None = None
        # Told the batches each committed transaction set aside (``traceml-daemon ingest``
        # names them in its report).
        self.on_quarantine: Callable[[list[Quarantined]], Any] | None = None

    async def open(self) -> None:
        require_private_api()
        await asyncio.to_thread(migrate, self.path)
        if self.tune_gil:
            self.hygiene.start()
        try:
            self._db = db = await aiosqlite.connect(self.path, isolation_level=None)
            for pragma in [*PRAGMAS, *self.policy.writer_pragmas()]:
                await db.execute(pragma)
            self.ingestor = await load_ingestor(db)
            await load_reservoir(db, self.history.reservoir)
            stored = await load_counters(db)
            self.counters.load(stored)
            self._stored_counters = dict(stored)
            states = {s.rank_id: s for s in self.ingestor.known.values()}
            if await catch_up_history(db, self.history, states):
                await self._flush_history_now()
        except BaseException:
            # The connection's thread would keep the process alive after a failed open.
            await self._release()
            raise
        self.checkpointer.start()  # last: an open() that failed leaves no thread behind

    async def _release(self) -> None:
        """Close the connection (if open) and undo the process settings, whatever fails."""
        try:
            if self._db is not None:
                db, self._db = self._db, None
                await db.close()
        finally:
            self.hygiene.stop()
            wal_index.release_unnamed()  # the -shm descriptor the checkpointer kept, once SQLite removed the file

    async def _flush_history_now(self) -> None:
        assert self._db is not None
        if not await self.history.flush(self._db):
            self.counters.history_writes_dropped += 1

    def statistics(self) -> dict[str, int]:
        """Sizes of what the writer keeps between transactions (memory diagnosis)."""
        return {
            **self.ingestor.statistics(), "backlog_rows": self.history.backlog.rows,
            "history_ranks": len(self.history.pending.ranks), "reservoir_ranks": len(self.history.reservoir.states),
        }

    async def close(self) -> None:
        try:
            if self._db is not None:
                await self._flush_history_now()
                await self.write([])  # persist the final counters
        finally:
            await asyncio.to_thread(self.checkpointer.stop)
            await self._release()

    def maybe_collect_garbage(self) -> int | None:
        """See ``ProcessHygiene.maybe_collect_garbage``."""
        return self.hygiene.maybe_collect_garbage()

    @property
    def _next_gc(self) -> float:
        """``hygiene.next_gc`` (tests/traceml_daemon/store/test_store.py sets it)."""
        return self.hygiene.next_gc

    @_next_gc.setter
    def _next_gc(self, when: float) -> None:
        self.hygiene.next_gc = when

    async def maybe_enforce_retention(self) -> None:
        """After a transaction: a retention pass when one is due (``RetentionSchedule``)."""
        self.counters.rows_deleted_by_retention += await self.retention.maybe_run(self._db)

    async def enforce_retention(self) -> int:
        """One bounded retention pass now; returns raw rows deleted."""
        deleted = await self.retention.run(self._db)
        self.counters.rows_deleted_by_retention += deleted
        return deleted

    async def _make_room(self) -> int:
        """The disk is full: the oldest raw rows deleted now, where a size cap allows it."""
        assert self._db is not None
        deleted = await make_room(self._db, self.retention.policy, self.retention.sweep)
        self.counters.rows_deleted_by_retention += deleted
        return deleted

    async def run(self, queue: ByteQueue[WorkItem]) -> None:
        """Drain ``queue`` until it is closed and empty.

        Stage the next transaction while the previous one is written (decoding runs
        in the event loop, sqlite on aiosqlite's thread, so they overlap), and hand it
        to the database thread before the previous one ends: at most two are out at
        once, the one running and the next queued behind it.
        """
        writing: collections.deque[asyncio.Task[bool]] = collections.deque()  # oldest first
        last: _Submitted | None = None
        while True:
            taken = await queue.get_many(self.max_txn_bytes, self.flush_interval)
            if not taken and queue.closed and len(queue) == 0:
                break
            self.maybe_collect_garbage()
            size = sum(n for _, n in taken)
            if (
                taken
                and self.coalesce_s > 0
                and size < self.max_txn_bytes // 4
                and all(task.done() for task in writing)
                and not queue.closed
            ):
                # Idle writer, little queued: many relays flushing at their own times
                # would each get a transaction of their own, and per-transaction costs
                # (commit, a ranks row per rank) would dominate. Wait a moment so one
                # transaction carries them all. A busy writer needs no wait: the next
                # batch piles up while the previous one is written.
                await asyncio.sleep(self.coalesce_s)
                taken += await queue.get_many(self.max_txn_bytes - size, 0)
            staged = self.stage([item for item, _ in taken], sum(n for _, n in taken))
            failed = False
            # Wait for every earlier transaction where this one must follow them all:
            # history is written only with nothing ahead of it (its fold needs their
            # committed steps), after a failure the chain starts anew, and work whose
            # staging failed is written apart behind everything else.
            settle = self.history.due_now(False) or self._chain.broken or staged.error is not None
            while writing and (settle or failed or len(writing) > 1 or writing[0].done()):
                failed = not await writing.popleft() or failed
            if failed or staged.plan.epoch != self.ingestor.epoch:
                # An earlier transaction failed (or was rolled back after this one was
                # staged): what this one deduplicated against may be rows never stored.
                # Its own marks go first, or the new staging would deduplicate against them.
                self.ingestor.discard(staged.plan)
                staged = self.stage(staged.work, staged.taken_bytes)
            ahead = last.finished if writing and last is not None else None
            last = await self._submit(staged)
            writing.append(asyncio.create_task(self._write_and_ack(last, queue, ahead)))
            if staged.error is not None:
                # Nothing may be staged before its items, written apart now, set their marks.
                await writing.pop()
        while writing:
            await writing.popleft()

    async def _write_and_ack(
        self, submitted: _Submitted, queue: ByteQueue[WorkItem], ahead: asyncio.Future[None] | None
    ) -> bool:
        """Finish ``submitted`` and acknowledge its batches (or fail them); True when it
        committed as staged (False: what was staged after it must be staged again)."""
        clean = False
        try:
            if ahead is not None:
                # Transactions finish in the order they were handed over (their
                # counters, marks and steps build on the ones before).
                await asyncio.wait([ahead])
            clean = await self._finish(submitted)
        finally:
            if not submitted.finished.done():
                submitted.finished.set_result(None)
            staged = submitted.staged
            await queue.release(staged.taken_bytes)
            acks = submitted.acks or [False] * len(staged.work)
            for item, ok in zip(staged.work, acks, strict=True):
                if item.done is not None:
                    item.done(ok)
        await self.maybe_enforce_retention()
        return clean

    def stage(self, work: list[WorkItem], taken_bytes: int = 0) -> Staged:
        """Decode ``work`` into one transaction (pure CPU, the event loop's share). Should
        staging fail, ``Staged.error`` says so and the work is written apart."""
        work = live_only(work)
        try:
            return stage_live(self.ingestor, work, taken_bytes)
        except Exception as exc:
            log.error("staging %d batches failed (%s: %s): writing them apart", len(work), type(exc).__name__, exc)
            return Staged(work, taken_bytes, Plan(epoch=self.ingestor.epoch), [], error=exc)

    async def write(self, work: list[WorkItem]) -> bool:
        """Write ``work`` (possibly empty: counters only) in one transaction."""
        return await self.write_staged(self.stage(work))

    async def write_staged(self, staged: Staged) -> bool:
        """Write ``staged`` in one transaction and wait for it (and anything ahead of it);
        True when every batch of it is stored or set aside."""
        submitted = await self._submit(staged)
        await self._finish(submitted)
        return submitted.settled

    async def _submit(self, staged: Staged) -> _Submitted:
        """Hand ``staged`` to the database thread, behind whatever it is running.

        Its counters are the totals it will make: the committed ones plus what the
        transactions ahead of it add (they commit first, or it is skipped)."""
        assert self._db is not None, "open() first"
        if self.before_write is not None:
            await self.before_write()
        if staged.error is not None:
            return _Submitted(staged, None, {}, None, self._chain)  # written apart by _finish
        plan = staged.plan
        counters = self.counters.as_dict()
        adds = plan_adds(plan)
        for name, add in zip(PLAN_COUNTERS, adds, strict=True):
            counters[name] += self._uncommitted[name] + add
        # History's fold reads the backlog, which holds committed steps only: with a
        # transaction out, its steps are not there yet, and the history mark would say
        # they are written. So history goes only with nothing ahead (``run`` waits).
        head = self.history.take(force=False) if self._in_flight == 0 else None
        if plan.empty and counters == self._stored_counters and head is None:
            return _Submitted(staged, None, counters, None, self._chain)
        db = self._db
        statements = with_counters(staged, counters)
        if self._in_flight == 0 and self._chain.broken:
            self._chain = Chain()  # nothing queued behind the failure any more
        for name, add in zip(PLAN_COUNTERS, adds, strict=True):
            self._uncommitted[name] += add
        self._stored_counters = counters
        self._in_flight += 1
        # One call per transaction on the database thread (ingest/transactions.py).
        # History goes first: its mark must be read before this transaction's own rows go in.
        trim = head is not None and self.policy.trim_heap_after_history
        call = asyncio.ensure_future(
            on_db_thread(db, run_chained, self._chain, statements, head, trim, staged.tables)
        )
        # Let the call reach the database thread's queue now, in submission order.
        await asyncio.sleep(0)
        return _Submitted(staged, head, counters, call, self._chain)

    async def _finish(self, submitted: _Submitted) -> bool:
        """Wait for a submitted transaction; on COMMIT, commit its plan and queue its steps.
        True when it committed as staged; else it was rolled back, and written apart
        (ingest/recovery.py) when it failed for its data. ``submitted.acks`` says which
        batches to acknowledge either way."""
        staged, head, counters = submitted.staged, submitted.head, submitted.counters
        plan = staged.plan
        failure: Exception | None = staged.error
        if submitted.call is not None:
            try:
                await submitted.call
            except Exception as exc:
                failure = exc
                self.ingestor.rollback(plan)
                self.history.written(head, False)
                self._stored_counters = None  # what was stored is unknown: store them next time
            finally:
                self._in_flight -= 1
                for name, add in zip(PLAN_COUNTERS, plan_adds(plan), strict=True):
                    self._uncommitted[name] -= add
        if failure is None and submitted.call is None and staged.work and plan.epoch != self.ingestor.epoch:
            # Nothing to write because it deduplicated against marks a failed transaction
            # ahead of it rolled back: those batches were never stored, so no ack.
            failure = Skipped()
        if failure is not None:
            return await self._recover(submitted, failure)
        if submitted.call is None:  # nothing to write: its plan holds no marks either
            self.ingestor.commit(plan)
        else:
            self.history.written(head, True)
            self._committed(plan, counters)
        submitted.acks, submitted.settled = [True] * len(staged.work), True
        return True

    def _committed(self, plan: Plan, counters: dict[str, int]) -> None:
        """``plan`` committed with ``counters`` stored: its marks, counters and steps are current."""
        self.ingestor.commit(plan)
        self.disk_full.wrote()
        for name in PLAN_COUNTERS:
            setattr(self.counters, name, counters[name])
        if plan.steps_by_rank:
            self._queue_committed(plan)
        if plan.quarantined and self.on_quarantine is not None:
            self.on_quarantine(plan.quarantined)

    async def _recover(self, submitted: _Submitted, failure: Exception) -> bool:
        """After ``submitted`` failed (or was skipped behind a failure): when the data was
        at fault, write its work apart and set aside what fails alone; else leave it
        all unacknowledged, for the relays to resend. Returns False (not as staged)."""
        work = submitted.staged.work
        skipped = isinstance(failure, Skipped)
        # The transactions queued behind a failure learn from it whether to retry.
        recoverable = submitted.chain.recoverable if skipped else is_data_error(failure)
        full = submitted.chain.disk_full if skipped else is_disk_full(failure)
        if not skipped:
            submitted.chain.recoverable, submitted.chain.disk_full = recoverable, full
        submitted.acks = [False] * len(work)
        if full:
            rows = submitted.staged.plan.rows_stored
            settled = await self.disk_full.settle(work, rows, failure, self._write_alone, self._make_room)
            if settled is not None:
                submitted.acks, submitted.settled = settled
                return False
            recoverable = True  # written again, it failed for its data: written apart below
        if not recoverable:
            if skipped:
                log.error("write of %d batches skipped behind a failed one, not acknowledged", len(work))
            else:
                log.error("write of %d batches failed, not acknowledged: %s", len(work), failure)
            return False
        if not skipped:
            log.warning("write of %d batches failed for its data (%s: %s): writing them apart",
                        len(work), type(failure).__name__, failure)
        if submitted.head is not None:
            await self._flush_history_now()  # it was part of the failure: alone, it is dropped if it fails
        submitted.acks, submitted.settled = await write_apart(work, self._write_alone, whole_first=skipped)
        return False

    async def _write_alone(self, work: list[WorkItem], entries: list[Quarantined]) -> tuple[Outcome, Exception | None]:
        """Stage ``work`` and write it, with ``entries`` set aside, in one transaction of
        its own (``write_apart``'s writes: whatever was queued behind the failure is
        skipped, so the counters are the committed ones plus this plan's)."""
        assert self._db is not None
        try:
            staged = stage_live(self.ingestor, work)
        except Exception as exc:
            return Outcome.DATA, exc
        plan = staged.plan
        if entries:
            plan.quarantined += entries
            staged.statements += quarantine.statements(entries, time.time())
        counters = self.counters.as_dict()
        for name, add in zip(PLAN_COUNTERS, plan_adds(plan), strict=True):
            counters[name] += add
        try:
            statements = with_counters(staged, counters)
            await on_db_thread(self._db, run_transaction, statements, None, False, staged.tables)
        except Exception as exc:
            self.ingestor.rollback(plan)
            self._stored_counters = None
            return (Outcome.DATA if is_data_error(exc) else Outcome.OTHER), exc
        self._stored_counters = counters
        self._committed(plan, counters)
        return Outcome.STORED, None

    def _queue_committed(self, plan: Plan) -> None:
        """Hand a committed plan's steps to the history backlog and the live aggregates."""
        # Every rank with steps in this plan has its state in the plan's high-water marks.
        by_id = {s.rank_id: s for s in plan.high_water.values()}
        self.history.backlog.add(plan.steps_by_rank, by_id, plan.partials_by_rank)
        if self.aggregates is not None:
            # One call per rank and transaction: its batches are kept as they are.
            add = self.aggregates.add_batches
            for rank_id, batches in plan.steps_by_rank.items():
                state = by_id.get(rank_id)
                if state is None:
                    add(rank_id, batches)
                else:
                    add(rank_id, batches, global_rank=state.global_rank, node_rank=state.node_rank)
