"""The WAL checkpointer thread: reads the WAL's progress from the real ``-shm`` file,
copies the WAL back off the writer's thread, lets the writer start the WAL over,
and never disturbs the writer when it fails."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import sqlite3
import time
from pathlib import Path

import pytest

from tests.traceml_daemon.history_support import batch, ro
from traceml_daemon.ingest.pipeline import StoreWriter
from traceml_daemon.store import wal_index
from traceml_daemon.store.checkpointer import Checkpointer, wal_progress
from traceml_daemon.store.policy import IngestPolicy


def _wal_db(path: Path) -> sqlite3.Connection:
    """A writer-like connection whose own automatic checkpoint is off."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA wal_autocheckpoint=0")
    conn.execute("CREATE TABLE t (a INTEGER, b BLOB)")
    return conn


def _commit_pages(conn: sqlite3.Connection, rows: int = 50) -> None:
    conn.execute("BEGIN")
    conn.executemany("INSERT INTO t VALUES (?, ?)", [(i, os.urandom(400)) for i in range(rows)])
    conn.execute("COMMIT")


def _progress(path: Path) -> tuple[int, int] | None:
    header = wal_index.read_head(str(path), 132)  # never a plain open and close: see wal_index
    return None if header is None else wal_progress(header)


def _wait_for(condition, what: str, deadline_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < end, f"{what} did not happen"
        time.sleep(0.01)


def test_wal_progress_reads_what_sqlite_reports(tmp_path: Path) -> None:
    db = tmp_path / "w.db"
    conn = _wal_db(db)
    for _ in range(4):
        _commit_pages(conn)
    frames, copied = _progress(db)  # type: ignore[misc]
    assert frames > 10 and copied == 0
    _busy, in_wal, checkpointed = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    assert (in_wal, checkpointed) == (frames, frames)
    assert _progress(db) == (frames, frames)
    # The next transaction starts the WAL over: fewer frames, none copied yet.
    _commit_pages(conn, 1)
    restarted = _progress(db)
    assert restarted is not None and restarted[0] < frames and restarted[1] == 0


def test_wal_progress_refuses_what_is_not_a_wal_index_header() -> None:
    rng = random.Random(7)
    assert wal_progress(b"") is None
    assert wal_progress(b"\0" * 132) is None  # version 0
    for _ in range(500):
        header = rng.randbytes(rng.randrange(0, 200))
        got = wal_progress(header)
        assert got is None or (0 <= got[1] <= got[0])


def test_due_waits_for_a_full_cadence_then_catches_up_until_the_wal_starts_over(tmp_path: Path) -> None:
    cp = Checkpointer(str(tmp_path / "x.db"), interval_s=0.1, frames=100)
    assert not cp.due(None)
    assert not cp.due((99, 0))
    assert cp.due((100, 0))
    cp._catching_up = True  # what checkpoint() leaves behind
    assert cp.due((130, 100))  # committed while it copied: copy those too
    assert not cp.due((130, 130))
    assert not cp.due((20, 0))  # the WAL started over: back to the full cadence
    assert not cp.due((40, 30))


def test_the_thread_copies_the_wal_back_and_the_writer_then_starts_it_over(tmp_path: Path) -> None:
    db = tmp_path / "w.db"
    conn = _wal_db(db)
    cp = Checkpointer(str(db), interval_s=0.005, frames=20)
    cp.start()
    try:
        for _ in range(3):
            _commit_pages(conn)
        _wait_for(lambda: _progress(db) is not None and _progress(db)[1] > 0, "a checkpoint")  # type: ignore[index]
        frames_before = _progress(db)[0]  # type: ignore[index]
        _wait_for(lambda: _progress(db)[0] == _progress(db)[1], "the catch-up")  # type: ignore[index]
        _commit_pages(conn, 1)
        assert _progress(db)[0] < frames_before  # type: ignore[index]
    finally:
        cp.stop()
    assert cp.runs >= 1 and cp.frames_copied >= 20 and cp.errors == 0
    assert cp._thread is None
    assert conn.execute("SELECT count(*) FROM t").fetchone() == (151,)


def test_a_failing_checkpoint_is_counted_and_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    bad = tmp_path / "not-a-db"
    bad.write_bytes(b"this is not an SQLite database file" * 200)
    cp = Checkpointer(str(bad), interval_s=0.1, frames=1)
    conn = sqlite3.connect(bad)
    with caplog.at_level(logging.WARNING, logger="traceml_daemon.store.checkpointer"):
        cp.checkpoint(conn)
        cp.checkpoint(conn)
    assert cp.errors == 2 and cp.runs == 0
    assert len([r for r in caplog.records if "WAL checkpoint failed" in r.getMessage()]) == 1


def test_the_store_writer_checkpoints_on_the_thread_and_stops_it_at_close(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    policy = IngestPolicy(wal_autocheckpoint_pages=32, checkpoint_interval_s=0.005)

    async def run() -> Checkpointer:
        writer = StoreWriter(str(db), policy=policy)
        await writer.open()
        for i in range(6):  # ~250 KB of WAL: past the 32-page cadence
            assert await writer.write([batch(i + 1, [0, 1], i * 200, 200)])
        checkpointer = writer.checkpointer
        end = time.monotonic() + 30
        while checkpointer.runs == 0:
            assert time.monotonic() < end, "no checkpoint from the thread"
            await asyncio.sleep(0.01)
        thread = checkpointer._thread
        assert thread is not None and thread.is_alive()
        await writer.close()
        assert not thread.is_alive()
        return checkpointer

    checkpointer = asyncio.run(run())
    assert checkpointer.runs >= 1 and checkpointer.errors == 0
    assert ro(db).execute("SELECT count(*) FROM steps").fetchone() == (2400,)


def test_progress_is_none_without_a_wal_index_file(tmp_path: Path) -> None:
    cp = Checkpointer(str(tmp_path / "absent.db"), interval_s=0.1, frames=1)
    assert cp.read_progress() is None and not cp.due(cp.read_progress())
    db = tmp_path / "w.db"
    conn = _wal_db(db)
    _commit_pages(conn)
    assert Checkpointer(str(db), interval_s=0.1, frames=1).read_progress() == _progress(db)


def test_no_thread_when_the_interval_is_zero(tmp_path: Path) -> None:
    cp = Checkpointer(str(tmp_path / "x.db"), interval_s=0, frames=1)
    cp.start()
    assert cp._thread is None
    cp.stop()

