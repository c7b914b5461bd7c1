"""Retention of the raw tables keyed by step: scalars, layers, fingerprints.

They hold no clock of their own, so they follow their rank's steps: a row goes
once its rank's steps no longer reach back to its step (the rank's lowest step
left is later), or once its rank has no step left after it stored some
(``rank_history`` remembers every rank that stored a step); then its rows
without a step go too. A rank that never stored a step (a rollout worker that
only logs) follows the daemon's own clock instead: under an age limit, all its
rows go once nothing of it arrived within the limit (``ranks.last_seen``).

A table is read in rowid order, ``chunk_rows`` rows at a time, and only the
stale rows of a chunk are deleted, in one short transaction. Two ways through:

- from the front, right after the oldest steps went (size cap, full disk): the
  rows those steps leave stale are mostly the oldest, so this frees their pages
  at once; it stops at the first chunk that is not wholly stale;
- a sweep that resumes where the last pass stopped and wraps at the end, until it
  has come round once since steps last went: stale rows behind rows that stay
  (another run's, still inside the window) are reached as well, and a pass never
  does more than its chunk budget.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from traceml_daemon.store.chunk_delete import delete_chunk
from traceml_daemon.store.schema import rank_is

if TYPE_CHECKING:  # annotations only: the command line reads retention without loading aiosqlite
    import aiosqlite

STEP_KEYED_TABLES: tuple[str, ...] = ("scalars", "layers", "fingerprints")
# A rank's lowest step left: one search of steps_by_group, stopped at the first row.
LOWEST_STEP_SQL = f"SELECT step FROM steps WHERE {rank_is('?1')} ORDER BY step LIMIT 1"


async def _marks(db: aiosqlite.Connection, rank_ids: set[int], seen_before: float | None) -> dict[int, float]:
    """Per rank, the step below which its rows are stale: its lowest step left; past every
    step (inf: every row) when it has none left but stored some, or when it never stored one
    and was last seen before ``seen_before`` (the age limit, on the daemon's clock); else none
    (-inf)."""
    marks: dict[int, float] = {}
    for rank_id in rank_ids:
        async with db.execute(LOWEST_STEP_SQL, (rank_id,)) as cur:
            row = await cur.fetchone()
        if row is not None and row[0] is not None:
            marks[rank_id] = float(row[0])
            continue
        async with db.execute("SELECT 1 FROM rank_history WHERE rank_id = ? LIMIT 1", (rank_id,)) as cur:
            gone = await cur.fetchone() is not None
        if not gone and seen_before is not None:
            async with db.execute("SELECT last_seen FROM ranks WHERE rank_id = ?", (rank_id,)) as cur:
                row = await cur.fetchone()
            gone = row is not None and isinstance(row[0], (int, float)) and row[0] < seen_before
        marks[rank_id] = math.inf if gone else -math.inf
    return marks


@dataclass
class Chunk:
    read: int  # rows looked at
    deleted: int
    last_rowid: int  # the last row looked at (0: none)


async def trim_chunk(
    db: aiosqlite.Connection, table: str, after_rowid: int, chunk_rows: int, marks: dict[int, float],
    seen_before: float | None = None,
) -> Chunk:
    """Delete the stale rows among the ``chunk_rows`` rows of ``table`` after ``after_rowid``.
    ``marks`` caches each rank's mark for the caller's pass (a mark only rises as steps go,
    so one read early in a pass deletes less, never more)."""
    async with db.execute(
        f"SELECT rowid, rank_id, step FROM {table} WHERE rowid > ? ORDER BY rowid LIMIT ?", (after_rowid, chunk_rows)
    ) as cur:
        rows = list(await cur.fetchall())
    if not rows:
        return Chunk(0, 0, 0)
    unknown = {rank_id for _, rank_id, _ in rows} - marks.keys()
    if unknown:
        marks.update(await _marks(db, unknown, seen_before))
    stale = [rowid for rowid, rank_id, step in rows
             if (step < marks[rank_id] if step is not None else marks[rank_id] == math.inf)]
    deleted = 0
    if stale:
        deleted = await delete_chunk(
            db, f"DELETE FROM {table} WHERE rowid IN (SELECT value FROM json_each(?))", (json.dumps(stale),)
        )
    return Chunk(len(rows), deleted, int(rows[-1][0]))


async def trim_front(db: aiosqlite.Connection, chunk_rows: int, max_chunks: int) -> int:
    """Right after the oldest steps went: stale rows from the front of every table, until a
    chunk is not wholly stale (or ``max_chunks`` chunks per table). Returns rows deleted."""
    marks: dict[int, float] = {}
    total = 0
    for table in STEP_KEYED_TABLES:
        after = 0
        for _ in range(max_chunks):
            chunk = await trim_chunk(db, table, after, chunk_rows, marks)
            total += chunk.deleted
            if chunk.read < chunk_rows or chunk.deleted < chunk.read:
                break
            after = chunk.last_rowid
    return total


@dataclass
class _Lap:
    after: int = 0  # the sweep resumes after this rowid
    until: int = 0  # where the lap began: done once the sweep wraps and comes back to it
    wrapped: bool = False
    due: bool = False


@dataclass
class StepKeyedSweep:
    """The resumable sweep over the step-keyed tables (one per writer, kept between passes)."""

    laps: dict[str, _Lap] = field(default_factory=lambda: {t: _Lap() for t in STEP_KEYED_TABLES})
    lap_started: float = -math.inf  # monotonic time of the last lap begun

    def steps_deleted(self) -> None:
        """Steps went: every table owes a whole lap from where its sweep stands."""
        self.lap_started = time.monotonic()
        for lap in self.laps.values():
            lap.until, lap.wrapped, lap.due = lap.after, False, True

    def lap_if_older(self, every_s: float) -> None:
        """A lap at least every ``every_s`` under an age limit: ranks that never stored a step
        age out by the clock, with no step deleted to start one."""
        if time.monotonic() - self.lap_started >= every_s:
            self.steps_deleted()

    @property
    def due(self) -> bool:
        return any(lap.due for lap in self.laps.values())

    async def run(
        self, db: aiosqlite.Connection, chunk_rows: int, budget: int, seen_before: float | None = None
    ) -> tuple[int, int]:
        """Sweep on within ``budget`` chunks, a chunk of each due table in turn (under steady
        deletion a lap never ends, and no table may starve the others); (rows deleted, chunks used)."""
        marks: dict[int, float] = {}
        total = used = 0
        while used < budget and self.due:
            for table, lap in self.laps.items():
                if not lap.due or used >= budget:
                    continue
                chunk = await trim_chunk(db, table, lap.after, chunk_rows, marks, seen_before)
                used += 1
                total += chunk.deleted
                if chunk.read < chunk_rows:  # the end: wrap to the front
                    lap.after, lap.wrapped = 0, True
                else:
                    lap.after = chunk.last_rowid
                if lap.wrapped and lap.after >= lap.until:
                    lap.due = False
        return total, used
