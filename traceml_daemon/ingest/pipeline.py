"""The single writer: drains the inbound queue into large SQLite transactions.

One task, one aiosqlite connection (its own thread), so the event loop never
blocks on disk and there is never write contention. Each transaction holds
every queued batch (up to ``max_txn_bytes``): rows go in as multi-row INSERTs
per table (see below for why not ``executemany``), ranks and their dedup
high-water marks are upserted, counters are stored, and only after COMMIT are
the senders acknowledged.

Two things keep a 2-core machine fed:

* Pipelining: transaction N+1 is staged (bodies decoded) in the event loop
  while N runs on aiosqlite's thread, and queued on that thread behind N
  before N ends, so the thread goes from one COMMIT straight to the next
  BEGIN while the event loop acknowledges N. Queued behind a transaction
  that fails, a transaction is skipped (``_Chain``): it was staged against
  the failed one's dedup marks.
* Few GIL hand-offs: Python's sqlite3 releases the GIL around every
  ``sqlite3_step``; with one step per row, the writer thread waits for the
  GIL (up to the switch interval) after every row whenever the event loop is
  busy, which cut throughput 4x. Rows therefore go in as multi-row
  ``INSERT ... VALUES (...), (...)`` statements of ``ROWS_PER_STATEMENT``
  rows (one step each), and the switch interval is lowered to 1 ms.

After COMMIT the writer queues the committed steps, then acks:
their columns go to the history backlog (``store/backlog.py``) and to the
live aggregates, both O(1) per rank. History (``store/history.py``) is folded
from the backlog and written every ``history_interval`` seconds, up to a few
seconds with thousands of ranks (``IngestPolicy.history_interval_for``), or
once the backlog holds ``IngestPolicy.history_backlog_rows_for`` rows, and at
close, at the head of a row transaction; the fold runs on the database thread just before
that transaction, so a second's worth of folding never stalls the event loop
in one piece. Raw rows stay the acknowledged, durable data; history may lag by
one interval. Each history write also stores ``meta.history_steps_rowid``, the
highest steps rowid it covers, in the same transaction, so ``open()`` catches
up on the rows a crash left unfolded. Retention (``store/retention.py``) runs
between transactions in small chunks of its own.

Senders whose identity is already committed get a narrow ranks update (rank
id, last seen, last seq: all the dedup mark needs) instead of the full
18-column upsert.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import ctypes.util
import functools
import gc
import logging
import sqlite3
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from itertools import chain, islice
from typing import Any

import aiosqlite

from traceml_daemon.ingest.backlog import StepBacklog
from traceml_daemon.ingest.counters import AGENT_PREFIX, DAEMON_SOURCE, RELAY_PREFIX, Counters
from traceml_daemon.ingest.decode import RANK_COLUMNS, TABLE_COLUMNS, Ingestor, Plan, RankState
from traceml_daemon.ingest.live import Aggregates
from traceml_daemon.net.inbound import ByteQueue
from traceml_daemon.store import history
from traceml_daemon.store.checkpointer import Checkpointer
from traceml_daemon.store.gc_pause import gc_paused
from traceml_daemon.store.migrate import migrate
from traceml_daemon.store.policy import DEFAULT_POLICY, IngestPolicy
from traceml_daemon.store.retention import RetentionPolicy, enforce
from traceml_daemon.store.schema import PRAGMAS
from traceml_wire.tables import Column, columns

log = logging.getLogger("traceml_daemon.writer")


_IDENTITY_UPDATE = ", ".join(
    f"{col}=coalesce(excluded.{col}, {col})"
    for col in RANK_COLUMNS
    if col not in ("rank_id", "sender", "session", "attempt", "first_seen", "last_seen", "last_seq")
)
_RANK_CONFLICT = (
    f"ON CONFLICT(sender) DO UPDATE SET last_seen=excluded.last_seen, "
    f"last_seq=max(last_seq, excluded.last_seq), {_IDENTITY_UPDATE}"
)
_UPSERT_RANK = (
    f"INSERT INTO ranks ({', '.join(RANK_COLUMNS)}) VALUES ({', '.join('?' * len(RANK_COLUMNS))}) {_RANK_CONFLICT}"
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
    # False once the batch's connection has failed: it is dropped unstored (see stage).
    live: Callable[[], bool] | None = None


# sqlite >= 3.32 allows 32766 bound parameters per statement.
MAX_PARAMS = 32_000
ROWS_PER_STATEMENT = 2048

Statement = tuple[str, Sequence[Any]]  # one multi-row statement and its flat parameters
_chain = chain.from_iterable


@lru_cache(maxsize=512)
def _values_sql(head: str, tail: str, width: int, nrows: int) -> str:
    one = f"({', '.join('?' * width)})"
    return f"{head} VALUES {', '.join([one] * nrows)} {tail}".rstrip()


def _statement_sizes(width: int, nrows: int) -> Iterator[int]:
    """Rows per statement: full chunks of one shape, then the rest in power-of-two
    pieces, so few shapes exist (each is compiled once, then cached)."""
    per = 1
    while per * 2 <= min(ROWS_PER_STATEMENT, MAX_PARAMS // width):
        per *= 2
    at = 0
    size = per
    while at < nrows:
        while size > nrows - at:
            size //= 2
        yield size
        at += size


def multi_row(parts: history.SqlParts, flat: Sequence[Any], nrows: int) -> list[Statement]:
    """Statements inserting ``nrows`` rows whose parameters are ``flat`` (row-major),
    each statement one sqlite3_step (see ``_statement_sizes``)."""
    head, tail, width = parts
    out: list[Statement] = []
    at = 0
    for size in _statement_sizes(width, nrows):
        out.append((_values_sql(head, tail, width, size), flat[at * width : (at + size) * width]))
        at += size
    return out


def multi_row_stream(parts: history.SqlParts, rows: Iterable[Iterable[Any]], nrows: int) -> Iterator[Statement]:
    """Like ``multi_row``, each statement's parameters built only when it is reached
    (``rows``: ``nrows`` iterables of a row's values, flattened in C): a history write
    holds ~10^6 parameters, and building them all first doubled its peak memory."""
    head, tail, width = parts
    it = iter(rows)
    for size in _statement_sizes(width, nrows):
        yield _values_sql(head, tail, width, size), list(_chain(islice(it, size)))


def multi_row_tuples(parts: history.SqlParts, rows: Iterable[tuple[Any, ...]]) -> list[Statement]:
    flat = list(chain.from_iterable(rows))
    return multi_row(parts, flat, len(flat) // parts[2])


# Tables holding one row per rank (schema v3): a new row replaces the rank's last.
LATEST_ONLY_TABLES = frozenset({"status"})


def _table_parts(table: str) -> history.SqlParts:
    cols = ("rank_id", *columns(table))
    verb = "INSERT OR REPLACE" if table in LATEST_ONLY_TABLES else "INSERT"
    return f"{verb} INTO {table} ({', '.join(cols)})", "", len(cols)


_TABLE_PARTS = {name: _table_parts(name) for name in TABLE_COLUMNS}
_RANK_PARTS: history.SqlParts = (f"INSERT INTO ranks ({', '.join(RANK_COLUMNS)})", _RANK_CONFLICT, len(RANK_COLUMNS))
# Senders whose full ranks row is already committed: only the dedup mark and
# last_seen change, and a 3-column UPDATE ... FROM (VALUES ...) costs a fraction
# of the 18-column upsert with its coalesce per identity column.
_RANK_TOUCH_PARTS: history.SqlParts = (
    "UPDATE ranks SET last_seen=v.column2, last_seq=max(ranks.last_seq, v.column3) FROM (",
    ") AS v WHERE ranks.rank_id=v.column1",
    3,
)
_MONOTONIC_PARTS: history.SqlParts = (
    "INSERT INTO delivery(source, counter, value)",
    "ON CONFLICT(source, counter) DO UPDATE SET value=max(value, excluded.value)",
    3,
)
_EXACT_PARTS: history.SqlParts = (
    "INSERT INTO delivery(source, counter, value)",
    "ON CONFLICT(source, counter) DO UPDATE SET value=excluded.value",
    3,
)


def chunk_statements(parts: history.SqlParts, chunks: list[tuple[int, list[Column]]]) -> list[Statement]:
    """Statements inserting every row of ``chunks`` ((rank_id, columns) per batch, in
    order): each row is the rank id, then its columns' values.

    Each statement's parameters are one list, filled by strided slice assignment
    (one C-level pass per column and batch piece): every value is copied once, where
    zipping rows into tuples, flattening them and slicing that per statement copied
    it three times (2x the time, ~190 against ~95 ns a 15-column row)."""
    head, tail, width = parts
    counts = [len(cols[0]) for _, cols in chunks]
    out: list[Statement] = []
    at_chunk = 0  # the batch the next row comes from, and where in it
    at_row = 0
    for size in _statement_sizes(width, sum(counts)):
        params: list[Any] = [None] * (size * width)
        filled = 0
        while filled < size:
            rank_id, cols = chunks[at_chunk]
            take = min(size - filled, counts[at_chunk] - at_row)
            start = filled * width
            stop = start + take * width
            params[start:stop:width] = [rank_id] * take
            whole = at_row == 0 and take == counts[at_chunk]
            for offset, col in enumerate(cols, 1):
                params[start + offset : stop : width] = col if whole else col[at_row : at_row + take]
            filled += take
            at_row += take
            if at_row == counts[at_chunk]:
                at_chunk += 1
                at_row = 0
        out.append((_values_sql(head, tail, width, size), params))
    return out


def _table_statements(table: str, chunks: list[tuple[int, list[Column]]]) -> list[Statement]:
    return chunk_statements(_TABLE_PARTS[table], chunks)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, where there is one."""
    name = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None


def _run_transaction(
    conn: sqlite3.Connection,
    statements: list[Statement],
    head: Callable[[], Iterable[Statement]] | None = None,
    trim: bool = False,
    tables: Sequence[Callable[[], list[Statement]]] = (),
) -> None:
    """The whole transaction in one call on the database thread: every aiosqlite
    call is a round trip through the event loop and a GIL hand-off, and while the
    loop is busy decoding, each hand-off can wait a whole switch interval.

    ``head`` (history) runs here too, on this thread, and its statements go first;
    so do ``tables``, which build the telemetry rows' statements (see ``Staged``)."""
    todo: Iterable[Statement] = statements if head is None else chain(head(), statements)
    if tables:
        todo = chain(todo, _chain(build() for build in tables))
    conn.execute("BEGIN IMMEDIATE")
    try:
        for sql, params in todo:
            conn.execute(sql, params)
        conn.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        raise
    if trim and (malloc_trim := _malloc_trim()) is not None:
        malloc_trim(0)  # a ctypes call: the GIL is released meanwhile


class _Skipped(Exception):
    """A transaction queued behind one that failed was not run."""


@dataclass
class _Chain:
    """Transactions queued on the database thread one behind another. Each was staged
    against the dedup marks of those ahead of it, so once one fails (``broken``, set on
    the database thread) the ones behind it must not commit either."""

    broken: bool = False


def _run_chained(chain: _Chain, conn: sqlite3.Connection, *args: Any) -> None:
    if chain.broken:
        raise _Skipped
    try:
        _run_transaction(conn, *args)
    except BaseException:
        chain.broken = True
        raise


@dataclass
class Staged:
    """One transaction, ready to write: the plan and its statements (rows and ranks;
    counters and any due history are added at write time)."""

    work: list[WorkItem]
    taken_bytes: int
    plan: Plan
    statements: list[Statement]
    # Per telemetry table, what builds its INSERTs from the plan's decoded batches: run
    # on the database thread inside the transaction. Flattening the rows is the largest
    # per-row cost after decoding; on the event loop it delayed staging the next
    # transaction while the database thread, its history fold now mostly merged from
    # agents' partials, waited for work.
    tables: list[Callable[[], list[Statement]]] = field(default_factory=list)


@dataclass
class _Submitted:
    """A staged transaction handed to the database thread (``call`` None: nothing to write)."""

    staged: Staged
    head: Callable[[], Iterable[Statement]] | None
    counters: dict[str, int]
    call: asyncio.Future[Any] | None
    # Done once ``_finish`` has run (committed or not): the next one finishes after it.
    finished: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


# The daemon counters a plan adds to, each a Plan field of the same name (the rest are
# counted live by the server).
_PLAN_COUNTERS = ("rows_stored", "duplicates_discarded", "bad_bodies", "partials_refused")


def _plan_adds(plan: Plan) -> list[int]:
    """What ``plan`` adds to each of ``_PLAN_COUNTERS``."""
    return [getattr(plan, name) for name in _PLAN_COUNTERS]


HISTORY_MARK = "history_steps_rowid"
# Evaluated inside the history-writing transaction before its own rows go in: every
# steps row at or below it was committed earlier, hence folded into what is written.
_MARK_SQL = (
    "INSERT OR REPLACE INTO meta (key, value) VALUES (?, (SELECT coalesce(max(rowid), 0) FROM steps))",
    (HISTORY_MARK,),
)


@dataclass
class PendingHistory:
    """History folded from committed rows, not yet written."""

    ranks: dict[tuple[int, int, int], history.Stats] = field(default_factory=dict)
    nodes: dict[tuple[str, int, int, int, int], history.Stats] = field(default_factory=dict)
    reservoir: history.ReservoirUpdate = field(default_factory=history.ReservoirUpdate)

    @property
    def empty(self) -> bool:
        return not (self.ranks or self.nodes or self.reservoir.rows or self.reservoir.states)

    def absorb(self, later: PendingHistory) -> None:
        """Fold ``later`` (newer) into this one: sums merge, newer reservoir rows win."""
        for mine, theirs in ((self.ranks, later.ranks), (self.nodes, later.nodes)):
            if not mine:  # the usual case: one fold per write
                mine.update(theirs)
                continue
            for key, stats in theirs.items():
                have = mine.get(key)
                if have is None:
                    mine[key] = stats
                else:
                    history.merge_into(have, stats)
        self.reservoir.rows.update(later.reservoir.rows)
        self.reservoir.states.update(later.reservoir.states)

    def statements(self) -> Iterator[Statement]:
        """What writes it all, built statement by statement as the transaction runs
        (nothing may change this history until the iterator is spent)."""
        yield _MARK_SQL
        for parts, deltas in ((history.RANK_UPSERT_PARTS, self.ranks), (history.NODE_UPSERT_PARTS, self.nodes)):
            # Each item is (key, stats): flattened once more, a row's values.
            yield from multi_row_stream(parts, map(_chain, deltas.items()), len(deltas))
        rows, states = self.reservoir.rows, self.reservoir.states
        yield from multi_row_stream(history.RESERVOIR_UPSERT_PARTS, rows.values(), len(rows))
        yield from multi_row_stream(
            history.RESERVOIR_STATE_UPSERT_PARTS,
            ((rid, s.seen, s.next_take, s.w, s.size) for rid, s in states.items()),
            len(states),
        )


class StoreWriter:
    def __init__(
        self,
        path: str,
        counters: Counters | None = None,
        aggregates: Aggregates | None = None,
        *,
        policy: IngestPolicy = DEFAULT_POLICY,
        retention: RetentionPolicy | None = None,
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
        self.retention = retention
        self.tune_gil = tune_gil
        self.coalesce_s = self.policy.coalesce_s
        self.ingestor = Ingestor()
        self.reservoir = history.Reservoir()
        self.checkpointer = Checkpointer(path, self.policy.checkpoint_interval_s, self.policy.wal_autocheckpoint_pages)
        # Committed steps not folded yet, and history folded but not written yet
        # (a failed write keeps it for the next one).
        self.backlog = StepBacklog()
        self.pending_history = PendingHistory()
        self._history_due = 0.0
        self._db: aiosqlite.Connection | None = None
        # The counters of the last transaction handed to the database thread (None: store
        # them with the next one, whatever they are).
        self._stored_counters: dict[str, int] | None = {}
        # What handed-over transactions not yet committed add to the plan counters: the
        # next one stores the totals they will reach.
        self._uncommitted: dict[str, int] = dict.fromkeys(_PLAN_COUNTERS, 0)
        self._in_flight = 0  # transactions handed to the database thread, not finished
        self._chain = _Chain()
        self._next_retention = 0.0
        self._retention_behind = False  # the last pass ran out of budget (see enforce_retention)
        self._retention_running = False
        # open() pauses automatic collection until close() (see IngestPolicy.gc_interval_s).
        self._gc_pause = contextlib.ExitStack()
        self._next_gc = float("inf")
        # Test hook: awaited before every transaction (a test can stall the writer with it).
        self.before_write: Callable[[], Any] | None = None

    async def open(self) -> None:
        await asyncio.to_thread(migrate, self.path)
        if self.tune_gil:
            # Process-wide, and deliberate: the daemon's writer thread must get the GIL
            # back quickly after each sqlite3_step (see the module docstring).
            sys.setswitchinterval(min(sys.getswitchinterval(), self.policy.gil_switch_interval))
            # Also process-wide: collection on a timer instead of allocation counts
            # (see IngestPolicy.gc_interval_s), and what exists at start (modules,
            # classes) is never walked again. close() turns automatic collection back on.
            gc.freeze()
            self._gc_pause.enter_context(gc_paused())
            self._next_gc = time.monotonic() + self.policy.gc_interval_s
        self._db = await aiosqlite.connect(self.path, isolation_level=None)
        for pragma in [*PRAGMAS, *self.policy.writer_pragmas()]:
            await self._db.execute(pragma)
        known: dict[str, RankState] = {}
        top = 0
        async with self._db.execute(
            "SELECT sender, rank_id, last_seq, global_rank, node_rank, session, attempt, world_size FROM ranks"
        ) as cur:
            async for sender, rank_id, last_seq, global_rank, node_rank, session, attempt, world_size in cur:
                known[sender] = RankState(rank_id, last_seq, global_rank, node_rank, session, attempt, world_size)
                top = max(top, rank_id)
        self.ingestor = Ingestor(known, next_rank_id=top + 1)
        async with self._db.execute("SELECT rank_id, seen, next_take, w, size FROM reservoir_state") as cur:
            self.reservoir.load([tuple(row) async for row in cur])  # type: ignore[misc]
        async with self._db.execute(
            "SELECT counter, value FROM delivery WHERE source=?", (DAEMON_SOURCE,)
        ) as cur:
            stored = {counter: value async for counter, value in cur}
        self.counters.load(stored)
        self._stored_counters = dict(stored)
        await self._catch_up_history()
        self.checkpointer.start()  # last: an open() that failed leaves no thread behind

    async def _catch_up_history(self) -> None:
        """Fold the steps a crash left out of history (rowid above the mark), and write them.

        A database without the mark had its history written with every transaction
        (older daemons, or a migration's backfill): it is current up to its last row."""
        assert self._db is not None
        async with self._db.execute("SELECT value FROM meta WHERE key=?", (HISTORY_MARK,)) as cur:
            row = await cur.fetchone()
        if row is None:
            await self._db.execute(_MARK_SQL[0], _MARK_SQL[1])
            return
        by_rank: dict[int, list[list[Any]]] = {}
        # history.HISTORY_COLUMNS, where they sit in a SELECTed row (after rank_id).
        picked = [1 + TABLE_COLUMNS["steps"].index(name) for name in history.HISTORY_COLUMNS]
        # Rowid order is commit order, so the reservoir sees each rank's points in the
        # order it would have live, and continues its sample from the saved state.
        async with self._db.execute(
            f"SELECT rank_id, {', '.join(TABLE_COLUMNS['steps'])} FROM steps WHERE rowid > ? ORDER BY rowid",
            (int(row[0]),),
        ) as cur:
            async for values in cur:
                cols = by_rank.get(values[0])
                if cols is None:
                    cols = by_rank[values[0]] = [[] for _ in picked]
                for col, at in zip(cols, picked, strict=True):
                    col.append(values[at])
        if not by_rank:
            return
        states = {s.rank_id: s for s in self.ingestor.known.values()}
        self._fold_history(((rank_id, cols, None) for rank_id, cols in by_rank.items()), states)
        log.info("history caught up on %d ranks' unfolded steps", len(by_rank))
        await self._flush_history_now()

    def _fold_history(
        self,
        columns_by_rank: Iterable[tuple[int, history.Columns, list[tuple[int, history.Stats]] | None]],
        states: dict[int, RankState],
    ) -> None:
        """Add committed steps ((rank_id, columns in ``history.HISTORY_COLUMNS`` order, their
        fine buckets if their agents sent them, else None), one rank at a time) to the
        pending history (pure CPU, nothing written)."""
        pending = self.pending_history
        deltas: dict[tuple[int, int, int], history.Stats] = {}
        offer = self.reservoir.offer_columns
        size_for = self.policy.reservoir_size_for
        for rank_id, cols, fine in columns_by_rank:
            if fine is None:
                history.add_rank_deltas(rank_id, cols, deltas)
            else:
                history.add_fine_deltas(rank_id, fine, deltas)
            # The size a new sample gets from its job (offer_columns keeps a started one's).
            st = states.get(rank_id)
            offer(rank_id, cols, pending.reservoir, size_for(st.world_size if st is not None else None))

        def node_of(rank_id: int) -> history.NodeKey | None:
            st = states.get(rank_id)
            if st is None or st.node_rank is None:
                return None
            return (st.session or "unknown", st.attempt, st.node_rank)

        pending.absorb(PendingHistory(deltas, history.node_deltas(deltas, node_of)))

    def _history_due_now(self, force: bool) -> bool:
        if self.backlog.rows == 0 and self.pending_history.empty:
            return False
        if force or time.monotonic() >= self._history_due:
            return True
        return self.backlog.rows >= self.policy.history_backlog_rows_for(len(self.ingestor.known))

    def _history_head(self, backlog: StepBacklog) -> Iterator[Statement]:
        """Fold ``backlog`` into the pending history and return what writes it all.

        Runs on the database thread, inside the transaction's call: the event loop
        does not touch the reservoir or the pending history while a write is out."""
        if backlog.rows:
            self._fold_history(backlog.columns(), backlog.states)
        return self.pending_history.statements()

    def _take_history(self, force: bool) -> Callable[[], Iterable[Statement]] | None:
        """The history head for the next transaction if history is due (or ``force``)."""
        if not self._history_due_now(force):
            return None
        backlog = self.backlog.take()
        return lambda: self._history_head(backlog)

    def _history_written(self, head: Callable[[], Iterable[Statement]] | None, ok: bool) -> None:
        if head is None:
            return
        if ok:
            interval = self.policy.history_interval_for(len(self.ingestor.known))
            self._history_due = time.monotonic() + interval
            self.pending_history = PendingHistory()
        # Not written: what was folded stays pending, ahead of anything folded later.

    async def _flush_history_now(self) -> None:
        assert self._db is not None
        head = self._take_history(force=True)
        if head is None:
            return
        try:
            await self._db._execute(_run_transaction, self._db._conn, [], head)
        except (sqlite3.Error, OSError) as exc:
            # Raw rows are safe; the next open catches history up from them.
            log.error("history write failed: %s", exc)
            self._history_written(head, False)
            return
        self._history_written(head, True)

    def statistics(self) -> dict[str, int]:
        """Sizes of what the writer keeps between transactions (memory diagnosis)."""
        return {
            **self.ingestor.statistics(), "backlog_rows": self.backlog.rows,
            "history_ranks": len(self.pending_history.ranks), "reservoir_ranks": len(self.reservoir.states),
        }

    async def close(self) -> None:
        if self._db is not None:
            await self.write([])  # persist the final counters
            await self._flush_history_now()
            await asyncio.to_thread(self.checkpointer.stop)
            await self._db.close()
            self._db = None
        self._next_gc = float("inf")
        self._gc_pause.close()  # automatic collection as it was before open()

    def maybe_collect_garbage(self) -> int | None:
        """A full cyclic collection when one is due (see IngestPolicy.gc_interval_s);
        returns the unreachable objects it found, or None when none was due."""
        now = time.monotonic()
        if now < self._next_gc:
            return None
        found = gc.collect()
        self._next_gc = time.monotonic() + self.policy.gc_interval_s
        log.debug("garbage collection: %d unreachable objects, %.1f ms", found, 1000 * (time.monotonic() - now))
        return found

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
                # (commit, a ranks row per rank) would dominate. Wait a
                # moment so one transaction carries them all. A busy writer needs no
                # wait: the next batch piles up while the previous one is written.
                await asyncio.sleep(self.coalesce_s)
                taken += await queue.get_many(self.max_txn_bytes - size, 0)
            staged = self.stage([item for item, _ in taken], sum(n for _, n in taken))
            failed = False
            # Wait for every earlier transaction where this one must follow them all:
            # history is written only with nothing ahead of it (its fold needs their
            # committed steps), and after a failure the chain starts anew.
            settle = self._history_due_now(False) or self._chain.broken
            while writing and (settle or failed or len(writing) > 1 or writing[0].done()):
                failed = not await writing.popleft() or failed
            if failed:
                # An earlier transaction failed and rolled every pending mark back:
                # what was staged after it deduplicated against rows never stored.
                staged = self.stage(staged.work, staged.taken_bytes)
            ahead = last.finished if writing and last is not None else None
            last = await self._submit(staged)
            writing.append(asyncio.create_task(self._write_and_ack(last, queue, ahead)))
        while writing:
            await writing.popleft()

    async def _write_and_ack(
        self, submitted: _Submitted, queue: ByteQueue[WorkItem], ahead: asyncio.Future[None] | None
    ) -> bool:
        ok = False
        try:
            if ahead is not None:
                # Transactions finish in the order they were handed over (their
                # counters, marks and steps build on the ones before).
                await asyncio.wait([ahead])
            ok = await self._finish(submitted)
        finally:
            if not submitted.finished.done():
                submitted.finished.set_result(None)
            staged = submitted.staged
            await queue.release(staged.taken_bytes)
            for item in staged.work:
                if item.done is not None:
                    item.done(ok)
        await self.maybe_enforce_retention()
        return ok

    async def maybe_enforce_retention(self) -> None:
        """After a transaction: a retention pass when one is due (every ``interval_s``)
        or when the last pass ran out of budget with work left."""
        due = self._retention_behind or time.monotonic() >= self._next_retention
        # Two transactions finish close together now: one pass at a time.
        if self.retention is not None and due and not self._retention_running:
            self._next_retention = time.monotonic() + self.retention.interval_s
            self._retention_running = True
            try:
                await self.enforce_retention()
            finally:
                self._retention_running = False

    async def enforce_retention(self) -> int:
        """One bounded retention pass; returns raw rows deleted. A pass that ran out of
        budget with work left makes the next one run after the next transaction, so
        retention keeps up with any ingest rate and ingest still never waits long."""
        assert self._db is not None, "open() first"
        if self.retention is None:
            return 0
        try:
            result = await enforce(self._db, self.retention, time.time())
        except sqlite3.Error as exc:
            log.error("retention failed: %s", exc)
            self._retention_behind = False
            return 0
        self._retention_behind = not result.done
        return result.deleted

    def stage(self, work: list[WorkItem], taken_bytes: int = 0) -> Staged:
        """Decode ``work`` into one transaction (pure CPU, the event loop's share).

        A batch whose connection has failed since it was queued is dropped, not
        acknowledged: its relay resends it, after the failed one, on a new connection."""
        kept: list[WorkItem] = []
        for item in work:
            if item.live is None or item.live():
                kept.append(item)
            elif item.done is not None:
                item.done(False)
        work = kept
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
        statements: list[Statement] = []
        if plan.ranks:
            statements += multi_row_tuples(_RANK_PARTS, plan.ranks.values())
        if plan.rank_touches:
            statements += multi_row_tuples(_RANK_TOUCH_PARTS, plan.rank_touches)
        tables = [functools.partial(_table_statements, table, chunks) for table, chunks in plan.chunks.items()]
        return Staged(work, taken_bytes, plan, statements, tables)

    async def write(self, work: list[WorkItem]) -> bool:
        """Write ``work`` (possibly empty: counters only) in one transaction."""
        return await self.write_staged(self.stage(work))

    async def write_staged(self, staged: Staged) -> bool:
        """Write ``staged`` in one transaction and wait for it (and anything ahead of it)."""
        return await self._finish(await self._submit(staged))

    async def _submit(self, staged: Staged) -> _Submitted:
        """Hand ``staged`` to the database thread, behind whatever it is running.

        Its counters are the totals it will make: the committed ones plus what the
        transactions ahead of it add (they commit first, or it is skipped)."""
        assert self._db is not None, "open() first"
        if self.before_write is not None:
            await self.before_write()
        plan = staged.plan
        counters = self.counters.as_dict()
        adds = _plan_adds(plan)
        for name, add in zip(_PLAN_COUNTERS, adds, strict=True):
            counters[name] += self._uncommitted[name] + add
        # History's fold reads the backlog, which holds committed steps only: with a
        # transaction out, its steps are not there yet, and the history mark would say
        # they are written. So history goes only with nothing ahead (``run`` waits).
        head = self._take_history(force=False) if self._in_flight == 0 else None
        if plan.empty and counters == self._stored_counters and head is None:
            return _Submitted(staged, None, counters, None)
        db = self._db
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
        if self._in_flight == 0 and self._chain.broken:
            self._chain = _Chain()  # nothing queued behind the failure any more
        for name, add in zip(_PLAN_COUNTERS, adds, strict=True):
            self._uncommitted[name] += add
        self._stored_counters = counters
        self._in_flight += 1
        # aiosqlite has no public "run this function on your thread"; its private
        # _execute is that, and one call per transaction is the point (see _run_transaction).
        # History goes first: its mark must be read before this transaction's own rows go in.
        trim = head is not None and self.policy.trim_heap_after_history
        call = asyncio.ensure_future(
            db._execute(_run_chained, self._chain, db._conn, statements, head, trim, staged.tables)
        )
        # Let the call reach the database thread's queue now, in submission order.
        await asyncio.sleep(0)
        return _Submitted(staged, head, counters, call)

    async def _finish(self, submitted: _Submitted) -> bool:
        """Wait for a submitted transaction; on COMMIT, commit its plan and queue its steps."""
        staged, head, counters = submitted.staged, submitted.head, submitted.counters
        plan = staged.plan
        if submitted.call is None:
            self.ingestor.commit(plan)
            return True
        try:
            await submitted.call
        except (sqlite3.Error, OSError, _Skipped) as exc:
            if isinstance(exc, _Skipped):
                log.error("write of %d batches skipped behind a failed one, not acknowledged", len(staged.work))
            else:
                log.error("write of %d batches failed, not acknowledged: %s", len(staged.work), exc)
            self.ingestor.rollback(plan)
            self._history_written(head, False)
            self._stored_counters = None  # what was stored is unknown: store them next time
            return False
        finally:
            self._in_flight -= 1
            for name, add in zip(_PLAN_COUNTERS, _plan_adds(plan), strict=True):
                self._uncommitted[name] -= add
        self._history_written(head, True)
        self.ingestor.commit(plan)
        for name in _PLAN_COUNTERS:
            setattr(self.counters, name, counters[name])
        if plan.steps_by_rank:
            # Every rank with steps in this plan has its state in the plan's high-water marks.
            by_id = {s.rank_id: s for s in plan.high_water.values()}
            self.backlog.add(plan.steps_by_rank, by_id, plan.partials_by_rank)
            if self.aggregates is not None:
                # One call per rank and transaction: its batches are kept as they are.
                add = self.aggregates.add_batches
                for rank_id, batches in plan.steps_by_rank.items():
                    state = by_id.get(rank_id)
                    if state is None:
                        add(rank_id, batches)
                    else:
                        add(rank_id, batches, global_rank=state.global_rank, node_rank=state.node_rank)
        return True
