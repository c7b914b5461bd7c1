"""Retention: bound raw telemetry by age and by database size; keep history.

The writer runs a pass between its transactions (so there is never a second
writer), when ``RetentionSchedule`` says one is due. Raw rows go oldest first,
in chunks of ``chunk_rows``, each chunk its own short transaction, so ingest
never waits long behind a delete.
Only raw time series are trimmed; ``rank_history``, ``node_history``, the
reservoir, ``ranks``, ``status`` (one row per rank) and ``delivery`` stay, so a
run's overview, counters and each rank's last status survive the raw rows.
The raw tables keyed by step (scalars, layers, fingerprints) have no clock:
they follow their rank's steps (``step_keyed.py``).

"Oldest" is rowid order: rows are appended as they arrive, so the first
rowids are the oldest, and a chunk is found through the rowid B-tree without
scanning (no ts index to maintain on the ingest path).

Age is counted back from the newest row of each table (its last rowid), never
from later than now: a database that receives nothing new keeps what it holds,
and a run replayed from old spools is not deleted as it arrives.

Size is the space the database uses, ``(page_count - freelist_count) *
page_size``: SQLite does not shrink the file after a DELETE, it reuses the
freed pages, so the file stays near ``max_db_bytes`` instead of growing.

``serve`` is bounded by default (``DEFAULT_RETENTION_DAYS``,
``DEFAULT_MAX_DB_MB``; ``--keep-everything`` turns both off). When the disk
fills before the cap, ``make_room`` deletes the oldest raw rows at once so the
writer can store what arrives (``ingest/disk_full.py``), where a size cap
allows deleting at all.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from traceml_daemon.store.chunk_delete import delete_chunk
from traceml_daemon.store.disk_full import is_disk_full
from traceml_daemon.store.step_keyed import StepKeyedSweep, trim_front

if TYPE_CHECKING:  # annotations only: the command line reads the defaults without loading aiosqlite
    import aiosqlite

log = logging.getLogger("traceml_daemon.retention")
# A failed pass is the writer's to report, under the writer's logger as before.
_writer_log = logging.getLogger("traceml_daemon.writer")

# serve's defaults: two weeks of raw rows, 20 GiB of database (MiB, as --max-db-mb counts).
# History is never trimmed, so a run's overview outlives both.
DEFAULT_RETENTION_DAYS = 14.0
DEFAULT_MAX_DB_MB = 20 * 1024.0

# Raw tables trimmed, with the column holding wall-clock time and its scale to seconds.
# ``status`` holds one row per rank (a rank's last word: finished or not) and stays.
RAW_TABLES: tuple[tuple[str, str, float], ...] = (
    ("steps", "ts", 1.0),
    ("process", "ts", 1.0),
    ("system", "ts", 1.0),
    ("gpu", "ts", 1.0),
    ("spans", "start_ns", 1e9),
    ("output", "ts", 1.0),
    ("rollout_sessions", "submit_ts", 1.0),
    ("session_phases", "start_ts", 1.0),
)


@dataclass
class RetentionPolicy:
    max_age_s: float | None = None
    max_db_bytes: int | None = None
    chunk_rows: int = 2000
    max_chunks: int = 50  # per call: bounded work between two ingest transactions
    interval_s: float = 5.0
    # Under an age limit, a sweep of the step-keyed tables at least this often, for the ranks
    # that never store a step (step_keyed.py): they age out by the clock.
    step_keyed_lap_s: float = 3600.0

    @classmethod
    def from_flags(cls, retention_days: float | None, max_db_mb: float | None) -> RetentionPolicy | None:
        if not retention_days and not max_db_mb:
            return None
        return cls(
            max_age_s=retention_days * 86400.0 if retention_days else None,
            max_db_bytes=int(max_db_mb * 1024 * 1024) if max_db_mb else None,
        )


async def used_bytes(db: aiosqlite.Connection) -> int:
    values = []
    for pragma in ("page_count", "freelist_count", "page_size"):
        async with db.execute(f"PRAGMA {pragma}") as cur:
            row = await cur.fetchone()
        values.append(int(row[0]) if row else 0)
    pages, free, size = values
    return (pages - free) * size


async def _fetch(db: aiosqlite.Connection, sql: str, params: tuple[float | int, ...] = ()) -> tuple[object, ...] | None:
    async with db.execute(sql, params) as cur:
        row = await cur.fetchone()
    return None if row is None else tuple(row)


async def _age_cutoff(
    db: aiosqlite.Connection, table: str, col: str, scale: float, policy: RetentionPolicy, now: float
) -> float | None:
    """The table's cutoff in its own unit when its oldest chunk holds a row before it, else None.

    Two indexed reads: a pass over tables with nothing old writes nothing."""
    assert policy.max_age_s is not None
    newest = await _fetch(db, f"SELECT {col} FROM {table} ORDER BY rowid DESC LIMIT 1")
    if newest is None or not isinstance(newest[0], (int, float)):
        return None
    cutoff = min(now * scale, float(newest[0])) - policy.max_age_s * scale
    old = await _fetch(
        db, f"SELECT 1 FROM (SELECT {col} AS t FROM {table} ORDER BY rowid LIMIT ?) WHERE t < ? LIMIT 1",
        (policy.chunk_rows, cutoff),
    )
    return None if old is None else cutoff


async def _trim_age(
    db: aiosqlite.Connection, policy: RetentionPolicy, now: float, budget: int, sweep: StepKeyedSweep
) -> tuple[int, int, bool]:
    """Delete rows older than the cutoff from every raw table; (rows, chunks used, done)."""
    total = chunks = 0
    for table, col, scale in RAW_TABLES:
        cutoff = await _age_cutoff(db, table, col, scale, policy, now)
        if cutoff is None:
            continue
        # Only the oldest chunk is examined each time: bounded work even when nothing is old.
        sql = (
            f"DELETE FROM {table} WHERE rowid IN (SELECT rowid FROM "
            f"(SELECT rowid, {col} AS t FROM {table} ORDER BY rowid LIMIT ?) WHERE t < ?)"
        )
        while True:
            if chunks >= budget:
                return total, chunks, False
            deleted = await delete_chunk(db, sql, (policy.chunk_rows, cutoff))
            chunks += 1
            total += deleted
            if deleted and table == "steps":
                sweep.steps_deleted()
            if deleted < policy.chunk_rows:
                break
    return total, chunks, True


async def _drop_oldest(db: aiosqlite.Connection, policy: RetentionPolicy, sweep: StepKeyedSweep) -> int | None:
    """Delete the oldest chunk of steps, the other raw rows no newer and the step-keyed rows
    this leaves stale; None when no steps are left."""
    row = await _fetch(
        db, "SELECT max(rowid), max(ts) FROM (SELECT rowid, ts FROM steps ORDER BY rowid LIMIT ?)", (policy.chunk_rows,)
    )
    if row is None or not isinstance(row[0], int):
        return None
    last_ts = row[1]
    deleted = await delete_chunk(db, "DELETE FROM steps WHERE rowid <= ?", (row[0],))
    if isinstance(last_ts, (int, float)):
        for table, col, scale in RAW_TABLES[1:]:
            deleted += await delete_chunk(
                db,
                f"DELETE FROM {table} WHERE rowid IN (SELECT rowid FROM "
                f"(SELECT rowid, {col} AS t FROM {table} ORDER BY rowid LIMIT ?) WHERE t <= ?)",
                (policy.chunk_rows, last_ts * scale),
            )
    sweep.steps_deleted()
    return deleted + await trim_front(db, policy.chunk_rows, policy.max_chunks)


async def _trim_size(
    db: aiosqlite.Connection, policy: RetentionPolicy, budget: int, sweep: StepKeyedSweep
) -> tuple[int, bool]:
    """Delete the oldest steps (and other raw rows no newer) until under the size cap; (rows, done)."""
    assert policy.max_db_bytes is not None
    total = 0
    for _ in range(budget):
        if await used_bytes(db) <= policy.max_db_bytes:
            return total, True
        deleted = await _drop_oldest(db, policy, sweep)
        if deleted is None:
            log.warning("database over --max-db-mb with no raw steps left to delete (history alone is larger)")
            return total, True
        total += deleted
    return total, await used_bytes(db) <= policy.max_db_bytes


async def make_room(
    db: aiosqlite.Connection, policy: RetentionPolicy | None, sweep: StepKeyedSweep | None = None
) -> int:
    """The disk is full below the size cap: delete a pass's worth of the oldest raw rows now, so
    their pages hold what arrives next. Only where a size cap is set: without one the user asked
    to keep every row whatever its size. Returns raw rows deleted (0: nothing could be freed)."""
    if policy is None or policy.max_db_bytes is None:
        return 0
    total = 0
    sweep = sweep or StepKeyedSweep()
    try:
        for _ in range(policy.max_chunks):
            deleted = await _drop_oldest(db, policy, sweep)
            if deleted is None:
                break
            total += deleted
    except (sqlite3.Error, OSError) as exc:
        # A delete writes to the WAL too, which a full disk may refuse: keep what was freed.
        log.warning("disk full: deleting old raw rows to make room failed: %s", exc)
    if total:
        log.warning("disk full: retention deleted the oldest %d raw rows to make room", total)
    return total


@dataclass(frozen=True)
class Enforced:
    deleted: int  # raw rows deleted
    # False: the chunk budget ran out with work left (ingest outpaces one pass every
    # interval_s); the writer then runs another pass after its next transaction.
    done: bool


async def enforce(
    db: aiosqlite.Connection, policy: RetentionPolicy, now: float, sweep: StepKeyedSweep | None = None
) -> Enforced:
    """Apply ``policy`` once, within its chunk budget. ``sweep``: the writer's, kept between
    passes (None: a sweep for this pass alone)."""
    sweep = sweep or StepKeyedSweep()
    deleted = 0
    done = True
    budget = policy.max_chunks
    if policy.max_age_s is not None:
        rows, used, done = await _trim_age(db, policy, now, budget, sweep)
        deleted += rows
        budget -= used
    if policy.max_db_bytes is not None:
        if budget > 0:
            rows, size_done = await _trim_size(db, policy, budget, sweep)
            deleted += rows
            done = done and size_done
        else:
            done = False
    seen_before = None
    if policy.max_age_s is not None:
        sweep.lap_if_older(policy.step_keyed_lap_s)
        seen_before = now - policy.max_age_s
    if sweep.due and budget > 0:
        # Not part of ``done``: a lap over big tables goes on at the pass interval.
        rows, _ = await sweep.run(db, policy.chunk_rows, budget, seen_before)
        deleted += rows
    if deleted:
        log.info("retention deleted %d raw rows", deleted)
    return Enforced(deleted, done)


class RetentionSchedule:
    """When the writer runs a pass of ``policy`` (None: never): after a transaction,
    every ``interval_s``, or after the very next one when the last pass ran out of
    budget with work left, so retention keeps up with any ingest rate and ingest
    never waits long. One pass at a time."""

    def __init__(self, policy: RetentionPolicy | None) -> None:
        self.policy = policy
        self._next = 0.0
        self._behind = False  # the last pass ran out of budget (see run)
        self._running = False
        self._disk_full_said = False  # a full disk fails every pass: the log says so once
        self.sweep = StepKeyedSweep()  # where the step-keyed tables' sweep stands

    async def maybe_run(self, db: aiosqlite.Connection | None) -> int:
        """After a transaction: a pass when one is due; returns raw rows deleted."""
        due = self._behind or time.monotonic() >= self._next
        # Two transactions finish close together: one pass at a time.
        if self.policy is not None and due and not self._running:
            self._next = time.monotonic() + self.policy.interval_s
            self._running = True
            try:
                return await self.run(db)
            finally:
                self._running = False
        return 0

    async def run(self, db: aiosqlite.Connection | None) -> int:
        """One bounded pass on ``db`` (the writer's, open); returns raw rows deleted.
        Failures are logged, not raised."""
        assert db is not None, "open() first"
        if self.policy is None:
            return 0
        try:
            result = await enforce(db, self.policy, time.time(), self.sweep)
        except (sqlite3.Error, OSError) as exc:
            self._behind = False
            if not is_disk_full(exc):
                _writer_log.error("retention failed: %s", exc)
            elif not self._disk_full_said:
                self._disk_full_said = True
                _writer_log.warning("retention cannot delete while the disk is full: %s", exc)
            return 0
        self._disk_full_said = False
        self._behind = not result.done
        return result.deleted
