"""A full disk (SQLite's ``PRAGMA max_page_count`` stands in for it: the same SQLITE_FULL):
serve's writer makes room where a size cap allows, acknowledges and counts what does not
fit, says so once, and goes on storing once writes fit again."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import sqlite3
from pathlib import Path

import pytest

from tests.traceml_daemon.history_support import batch, ro
from traceml_daemon.ingest.pipeline import StoreWriter, WorkItem
from traceml_daemon.net.inbound import ByteQueue
from traceml_daemon.store.disk_full import is_disk_full
from traceml_daemon.store.retention import RetentionPolicy

RANKS = [0, 1, 2, 3]


def _daemon_counters(db: Path) -> dict[str, int]:
    conn = ro(db)
    try:
        return dict(conn.execute("SELECT counter, value FROM delivery WHERE source='daemon'").fetchall())
    finally:
        conn.close()


def _steps(db: Path) -> tuple[int, int | None, int | None]:
    conn = ro(db)
    try:
        return conn.execute("SELECT count(*), min(step), max(step) FROM steps").fetchone()
    finally:
        conn.close()


async def _fill(writer: StoreWriter) -> None:
    """No page beyond those the database has now: the next sizeable write fails with SQLITE_FULL."""
    assert writer._db is not None
    async with writer._db.execute("PRAGMA page_count") as cur:
        pages = (await cur.fetchone())[0]  # type: ignore[index]
    await writer._db.execute(f"PRAGMA max_page_count = {pages}")


async def _unfill(writer: StoreWriter) -> None:
    assert writer._db is not None
    await writer._db.execute("PRAGMA max_page_count = 1073741823")


async def _run(writer: StoreWriter, items: list[WorkItem]) -> dict[int, bool]:
    """``items`` through the writer's own loop, as the server queues them; returns seq -> acknowledged."""
    acked: dict[int, bool] = {}
    queue: ByteQueue[WorkItem] = ByteQueue(1 << 24)
    for item in items:
        await queue.put(dataclasses.replace(item, done=lambda ok, seq=item.seq: acked.update({seq: ok})), 100)
    await queue.close()
    await writer.run(queue)
    return acked


def _disk_full_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "disk full" in r.getMessage() or "fit again" in r.getMessage()]


def test_recognises_sqlite_full_and_enospc() -> None:
    conn = sqlite3.connect(":memory:")
    conn.execute("PRAGMA max_page_count = 2")
    conn.execute("CREATE TABLE t (x)")
    with pytest.raises(sqlite3.OperationalError) as full:
        conn.executemany("INSERT INTO t VALUES (randomblob(4000))", [()] * 10)
    assert is_disk_full(full.value)
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert not is_disk_full(sqlite3.OperationalError("database is locked"))
    assert not is_disk_full(sqlite3.IntegrityError("UNIQUE constraint failed"))
    assert not is_disk_full(OSError(errno.EIO, "I/O error")) and not is_disk_full(None)


def test_serve_acknowledges_and_counts_what_a_full_disk_cannot_hold(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = tmp_path / "full.db"
    caplog.set_level(logging.INFO, logger="traceml_daemon")

    async def go() -> dict[int, bool]:
        writer = StoreWriter(str(db), drop_when_full=True, max_txn_bytes=1)  # one batch per transaction
        await writer.open()
        assert await writer.write([batch(1, RANKS, 0, 500)])
        await _fill(writer)
        acked = await _run(writer, [batch(seq, RANKS, (seq - 1) * 500, 500) for seq in (2, 3, 4)])
        assert writer.disk_full.full
        await _unfill(writer)
        acked |= await _run(writer, [batch(5, RANKS, 2000, 500)])
        await writer.close()
        return acked

    acked = asyncio.run(go())
    # Every batch acknowledged: stored (1, 5) or dropped and counted (2, 3, 4); none resent.
    assert acked == {2: True, 3: True, 4: True, 5: True}
    counters = _daemon_counters(db)
    assert counters["batches_dropped_disk_full"] == 3 * len(RANKS)
    assert counters["rows_dropped_disk_full"] == 3 * len(RANKS) * 500
    assert counters["rows_stored"] == 2 * len(RANKS) * 500
    assert _steps(db) == (2 * len(RANKS) * 500, 0, 2499)
    # Said once when the disk filled, once when writes fit again: not once per failed write.
    lines = _disk_full_lines(caplog)
    assert len(lines) == 2, lines
    assert lines[0].startswith("disk full") and "acknowledged unstored" in lines[0]
    assert "fit again" in lines[1] and "12 batches (6000 rows)" in lines[1]
    # The summary's delivery section counts those rows as lost.
    from traceml_daemon.store.read.delivery import delivery_counters

    conn = ro(db)
    assert delivery_counters(conn)["rows_dropped_reported"] == 3 * len(RANKS) * 500
    conn.close()


def test_a_writer_that_must_not_drop_leaves_the_batches_unacknowledged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``traceml-daemon ingest`` (no relay to acknowledge): a full disk is a failure, reported."""
    db = tmp_path / "ingest.db"
    caplog.set_level(logging.INFO, logger="traceml_daemon")

    async def go() -> dict[int, bool]:
        writer = StoreWriter(str(db), max_txn_bytes=1)
        await writer.open()
        assert await writer.write([batch(1, RANKS, 0, 500)])
        await _fill(writer)
        acked = await _run(writer, [batch(2, RANKS, 500, 500), batch(3, RANKS, 1000, 500)])
        await _unfill(writer)
        await writer.close()
        return acked

    assert asyncio.run(go()) == {2: False, 3: False}
    assert _daemon_counters(db).get("batches_dropped_disk_full", 0) == 0
    assert _steps(db) == (2000, 0, 499)
    assert len([line for line in _disk_full_lines(caplog) if line.startswith("disk full")]) == 1


def test_a_size_cap_makes_room_for_new_rows_on_a_full_disk(tmp_path: Path) -> None:
    """The disk is smaller than the size cap: the oldest raw rows go at once, the new ones are
    stored, and history still holds the whole run."""
    db = tmp_path / "room.db"
    cap = RetentionPolicy(max_db_bytes=1 << 40, chunk_rows=500, max_chunks=50)

    async def go() -> dict[int, bool]:
        writer = StoreWriter(str(db), retention=cap, drop_when_full=True, max_txn_bytes=1)
        await writer.open()
        assert await writer.write([batch(1, RANKS, 0, 1000)])
        await _fill(writer)
        acked = await _run(writer, [batch(2, RANKS, 1000, 500)])
        await writer.close()
        return acked

    assert asyncio.run(go()) == {2: True}
    counters = _daemon_counters(db)
    assert counters.get("batches_dropped_disk_full", 0) == 0
    assert counters["rows_deleted_by_retention"] > 0
    count, first, last = _steps(db)
    assert last == 1499 and first is not None and first > 0  # the oldest went, the newest are all there
    conn = ro(db)
    try:
        assert conn.execute("SELECT sum(n) FROM rank_history WHERE level = 64").fetchone()[0] == len(RANKS) * 1500
    finally:
        conn.close()
