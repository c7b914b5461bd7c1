"""Retention deletes the oldest raw rows (by age, by size) and keeps history and each rank's last status."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from tests.traceml_daemon.history_support import batch, random_steps, ro
from tests.traceml_daemon.wire_client import RELAY, agent_sender
from traceml_daemon.ingest.pipeline import StoreWriter, WorkItem
from traceml_daemon.store.retention import RetentionPolicy
from traceml_wire.body import encode_body


def _history(db: Path) -> list[tuple[object, ...]]:
    conn = ro(db)
    try:
        return conn.execute("SELECT * FROM rank_history ORDER BY rank_id, level, bucket").fetchall()
    finally:
        conn.close()


def test_age_retention_deletes_old_steps_in_chunks_and_keeps_history(tmp_path: Path) -> None:
    db = tmp_path / "age.db"
    now = time.time()
    old = batch(1, [0, 1], 0, 3000, ts0=now - 10 * 86400)  # ten days old
    new = batch(2, [0, 1], 3000, 500, ts0=now - 3000)  # recent

    async def go() -> int:
        writer = StoreWriter(str(db), retention=RetentionPolicy(max_age_s=7 * 86400, chunk_rows=500, max_chunks=1000))
        await writer.open()
        assert await writer.write([old]) and await writer.write([new])
        before = _history(db)
        deleted = await writer.enforce_retention()
        assert _history(db) == before  # history untouched
        await writer.close()
        return deleted

    assert asyncio.run(go()) == 6000
    conn = ro(db)
    assert conn.execute("SELECT count(*), min(step) FROM steps").fetchone() == (1000, 3000)
    assert conn.execute("SELECT sum(n) FROM rank_history WHERE level=64").fetchone()[0] == 7000


def test_size_retention_deletes_oldest_until_under_the_cap(tmp_path: Path) -> None:
    db = tmp_path / "size.db"
    batches = [batch(i + 1, [0, 1, 2, 3], i * 2500, 2500) for i in range(8)]  # 80,000 steps

    async def go() -> None:
        writer = StoreWriter(str(db))
        await writer.open()
        for b in batches:
            assert await writer.write([b])
        await writer.close()
        cap = RetentionPolicy(max_db_bytes=2 * 1024 * 1024, chunk_rows=2000, max_chunks=10_000)
        writer = StoreWriter(str(db), retention=cap)
        await writer.open()
        before = _history(db)
        assert await writer.enforce_retention() > 0
        assert _history(db) == before
        async with writer._db.execute("PRAGMA page_count") as cur:  # type: ignore[union-attr]
            assert (await cur.fetchone()) is not None
        await writer.close()

    asyncio.run(go())
    conn = ro(db)
    pages, free, size = (conn.execute(f"PRAGMA {p}").fetchone()[0] for p in ("page_count", "freelist_count", "page_size"))
    assert (pages - free) * size <= 2 * 1024 * 1024
    count, first = conn.execute("SELECT count(*), min(step) FROM steps").fetchone()
    assert 0 < count < 80_000
    # The oldest went first: what is left is the newest steps, contiguous to the end.
    assert conn.execute("SELECT max(step) FROM steps").fetchone()[0] == 19_999
    assert first > 0
    assert conn.execute("SELECT sum(n) FROM rank_history WHERE level=16384").fetchone()[0] == 80_000


def test_age_retention_keeps_each_ranks_last_status(tmp_path: Path) -> None:
    """status holds one row per rank (its last word, e.g. finished): not a time series to trim.
    Age counts back from the newest row, so another rank's recent step makes rank 0's old."""
    db = tmp_path / "status.db"
    old_ts = time.time() - 10 * 86400
    sender = agent_sender("s1", 0)
    body = encode_body({
        "steps": random_steps(0, 0, 100, 0, ts0=old_ts),
        "status": {"ts": [old_ts], "phase": ["idle"], "phase_since": [old_ts], "step": [99], "steps_done": [100],
                   "finished": [1]},
    })

    async def go() -> int:
        writer = StoreWriter(str(db), retention=RetentionPolicy(max_age_s=7 * 86400, chunk_rows=500, max_chunks=10))
        await writer.open()
        assert await writer.write([WorkItem(RELAY, "s1", 1, [[sender, 1, body]], {sender: {"global_rank": 0}}, {}, {})])
        assert await writer.write([batch(2, [1], 0, 1, ts0=time.time())])
        deleted = await writer.enforce_retention()
        await writer.close()
        return deleted

    assert asyncio.run(go()) == 100  # the old steps went
    conn = ro(db)
    assert conn.execute("SELECT count(*), min(rank_id) FROM steps").fetchone() == (1, 2)  # rank 1's recent step
    assert conn.execute("SELECT steps_done, finished FROM status").fetchall() == [(100, 1)]
    conn.close()


def test_size_retention_keeps_up_when_ingest_outpaces_one_pass_per_interval(tmp_path: Path) -> None:
    # A database already 3x over its cap, then steady ingest. One pass an hour by the
    # clock (2 chunks of 500 rows) would leave it over the cap for hours; a pass that
    # ran out of budget runs again after the next transaction, so retention catches up
    # within a few dozen transactions while ingest goes on (400 rows each).
    db = tmp_path / "busy.db"
    cap_bytes = 1024 * 1024
    policy = RetentionPolicy(max_db_bytes=cap_bytes, chunk_rows=500, max_chunks=2, interval_s=3600.0)
    used: list[int] = []

    async def go() -> None:
        writer = StoreWriter(str(db))
        await writer.open()
        for i in range(75):  # 30,000 steps, about 3 MB of raw rows
            assert await writer.write([batch(i + 1, [0, 1, 2, 3], i * 100, 100)])
        await writer.close()
        writer = StoreWriter(str(db), retention=policy)
        await writer.open()
        for i in range(75, 135):  # 24,000 more, 400 a transaction
            assert await writer.write([batch(i + 1, [0, 1, 2, 3], i * 100, 100)])
            await writer.maybe_enforce_retention()  # what the writer's loop does after each transaction
            async with writer._db.execute("PRAGMA page_count") as cur:  # type: ignore[union-attr]
                pages = (await cur.fetchone())[0]  # type: ignore[index]
            async with writer._db.execute("PRAGMA freelist_count") as cur:  # type: ignore[union-attr]
                free = (await cur.fetchone())[0]  # type: ignore[index]
            used.append((pages - free) * 4096)
        await writer.close()

    asyncio.run(go())
    assert used[0] > 2 * cap_bytes
    caught_up = next((i for i, size in enumerate(used) if size <= cap_bytes + 64 * 1024), None)
    assert caught_up is not None and caught_up < 50, used
    conn = ro(db)
    assert conn.execute("SELECT max(step) FROM steps").fetchone()[0] == 13_499  # the newest are kept
    assert conn.execute("SELECT count(*) FROM steps").fetchone()[0] < 30_000
