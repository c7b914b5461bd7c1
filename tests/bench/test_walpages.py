"""bench/walpages.py: WAL frames read back and attributed to the B-trees they belong to."""

from __future__ import annotations

import importlib.util
import random
import sqlite3
import sys
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("walpages", Path(__file__).parents[2] / "bench" / "walpages.py")
assert _SPEC is not None and _SPEC.loader is not None
walpages = importlib.util.module_from_spec(_SPEC)
sys.modules["walpages"] = walpages
_SPEC.loader.exec_module(walpages)


def _live_db(path: Path, commits: int) -> sqlite3.Connection:
    """A WAL database with ``commits`` committed transactions still in its WAL (open writer)."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA wal_autocheckpoint=0")  # keep every frame in the WAL
    conn.execute("CREATE TABLE t (k INTEGER, v TEXT)")
    conn.execute("CREATE INDEX t_by_k ON t (k)")
    for c in range(commits):
        conn.execute("BEGIN")
        conn.executemany("INSERT INTO t VALUES (?, ?)", [((i * 7919) % 1000, "x" * 50) for i in range(c * 500, c * 500 + 500)])
        conn.execute("COMMIT")
    return conn


def test_frames_are_counted_per_commit_and_attributed_to_table_and_index(tmp_path: Path) -> None:
    db = tmp_path / "live.db"
    writer = _live_db(db, commits=5)
    try:
        pages, commits, page_size = walpages.wal_frames(Path(f"{db}-wal").read_bytes())
        owners = walpages.page_owners(db)
    finally:
        writer.close()
    assert page_size == 4096
    assert commits == 5 + 2  # the CREATE TABLE and CREATE INDEX commit too
    names = {owners.get(p) for p in pages}
    assert {"t", "t_by_k", "sqlite_schema"} <= names


def test_frames_of_a_previous_wal_generation_are_not_counted(tmp_path: Path) -> None:
    db = tmp_path / "live.db"
    writer = _live_db(db, commits=3)
    try:
        writer.execute("PRAGMA wal_checkpoint(RESTART)")  # the next write starts the WAL over
        writer.execute("INSERT INTO t VALUES (1, 'y')")
        pages, commits, _ = walpages.wal_frames(Path(f"{db}-wal").read_bytes())
    finally:
        writer.close()
    assert commits == 1
    assert 1 <= len(pages) <= 3


def test_garbage_is_a_clear_error_or_an_empty_result() -> None:
    rng = random.Random(7)
    for _ in range(500):
        blob = rng.randbytes(rng.choice([0, 10, 31, 32, 33, 100, 5000]))
        if rng.random() < 0.5 and len(blob) >= 4:
            blob = bytes.fromhex("377f0682") + blob[4:]
        try:
            pages, commits, _ = walpages.wal_frames(blob)
        except ValueError as exc:
            assert "WAL" in str(exc)
        else:
            assert commits <= len(pages)


def test_a_truncated_wal_stops_at_its_last_whole_frame(tmp_path: Path) -> None:
    db = tmp_path / "live.db"
    writer = _live_db(db, commits=2)
    try:
        wal = Path(f"{db}-wal").read_bytes()
    finally:
        writer.close()
    whole, _, page_size = walpages.wal_frames(wal)
    cut, _, _ = walpages.wal_frames(wal[: len(wal) - page_size // 2])
    assert cut == whole[:-1]
    with pytest.raises(ValueError, match="not a WAL"):
        walpages.wal_frames(b"\0" * 64)
