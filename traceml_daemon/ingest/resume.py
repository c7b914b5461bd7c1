"""What the writer reads back when it opens a database: where ingest left off.

The ranks' dedup marks and identities (so resent batches are discarded), the
reservoir's sampling state, the daemon's stored counters, and the steps a crash
left out of history (rowid above ``meta.history_steps_rowid``), folded again so
history catches up on its first write.
"""

from __future__ import annotations

import logging
from typing import Any

import aiosqlite

from traceml_daemon.ingest.counters import DAEMON_SOURCE
from traceml_daemon.ingest.decode import TABLE_COLUMNS, Ingestor, RankState
from traceml_daemon.ingest.history_feed import HISTORY_MARK, MARK_SQL, HistoryFeed
from traceml_daemon.store import history

log = logging.getLogger("traceml_daemon.writer")


async def load_ingestor(db: aiosqlite.Connection) -> Ingestor:
    """An ``Ingestor`` that knows every stored rank, new rank ids above theirs."""
    known: dict[str, RankState] = {}
    top = 0
    async with db.execute(
        "SELECT sender, rank_id, last_seq, global_rank, node_rank, session, attempt, world_size FROM ranks"
    ) as cur:
        async for sender, rank_id, last_seq, global_rank, node_rank, session, attempt, world_size in cur:
            known[sender] = RankState(rank_id, last_seq, global_rank, node_rank, session, attempt, world_size)
            top = max(top, rank_id)
    return Ingestor(known, next_rank_id=top + 1)


async def load_reservoir(db: aiosqlite.Connection, reservoir: history.Reservoir) -> None:
    async with db.execute("SELECT rank_id, seen, next_take, w, size FROM reservoir_state") as cur:
        reservoir.load([tuple(row) async for row in cur])  # type: ignore[misc]


async def load_counters(db: aiosqlite.Connection) -> dict[str, int]:
    """The daemon's own delivery counters as last stored."""
    async with db.execute("SELECT counter, value FROM delivery WHERE source=?", (DAEMON_SOURCE,)) as cur:
        return {counter: value async for counter, value in cur}


async def catch_up_history(db: aiosqlite.Connection, feed: HistoryFeed, states: dict[int, RankState]) -> bool:
    """Fold the steps a crash left out of history into ``feed``'s pending history;
    True when there were any (write them then).

    A database without the mark had its history written with every transaction
    (older daemons, or a migration's backfill): it is current up to its last row,
    and gets the mark now."""
    async with db.execute("SELECT value FROM meta WHERE key=?", (HISTORY_MARK,)) as cur:
        row = await cur.fetchone()
    if row is None:
        await db.execute(MARK_SQL[0], MARK_SQL[1])
        return False
    by_rank: dict[int, list[list[Any]]] = {}
    # history.HISTORY_COLUMNS, where they sit in a SELECTed row (after rank_id).
    picked = [1 + TABLE_COLUMNS["steps"].index(name) for name in history.HISTORY_COLUMNS]
    # Rowid order is commit order, so the reservoir sees each rank's points in the
    # order it would have live, and continues its sample from the saved state.
    async with db.execute(
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
        return False
    try:
        feed.fold(((rank_id, cols, None) for rank_id, cols in by_rank.items()), states)
    except Exception as exc:
        # Rows an older daemon stored that history cannot read: the daemon must still open.
        log.error("history catch-up failed (%s: %s): those rows stay out of history", type(exc).__name__, exc)
        feed.drop()
        await db.execute(MARK_SQL[0], MARK_SQL[1])
        return False
    log.info("history caught up on %d ranks' unfolded steps", len(by_rank))
    return True
