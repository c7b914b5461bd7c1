"""A rank's newest host samples through the (time slice, rank, ts) index (schema v4)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from traceml_daemon.store import samples
from traceml_daemon.store.migrate import migrate
from traceml_daemon.store.schema import SAMPLE_SLICE_S


def _db(tmp_path: Path) -> sqlite3.Connection:
    db = tmp_path / "s.db"
    migrate(str(db))
    return sqlite3.connect(db, isolation_level=None)


def test_newest_rows_of_one_rank_newest_first_across_many_slices(tmp_path: Path) -> None:
    conn = _db(tmp_path)
    # Three ranks flushing every second for 1000 s, interleaved as they arrive.
    conn.executemany("INSERT INTO process (rank_id, ts, cpu_pct) VALUES (?, ?, ?)",
                     [(r, 5000.0 + t, float(t)) for t in range(1000) for r in (1, 2, 3)])
    conn.execute("INSERT INTO status (rank_id, ts) VALUES (2, 5999.0)")
    rows = samples.newest(conn, "process", "ts, cpu_pct", 2, 300)  # more than one query's slices
    assert [r[0] for r in rows] == [5999.0 - i for i in range(300)]
    assert samples.newest(conn, "process", "ts", 2, 1) == [(5999.0,)]
    # Without a status row the newest slice of the table is the end.
    assert samples.newest(conn, "process", "ts", 3, 2) == [(5999.0,), (5998.0,)]


def test_a_rank_that_stopped_early_is_read_back_from_its_own_last_flush(tmp_path: Path) -> None:
    conn = _db(tmp_path)
    conn.executemany("INSERT INTO system (rank_id, ts, cpu_pct) VALUES (?, ?, ?)",
                     [(1, 1000.0 + t, 1.0) for t in range(50)] + [(2, 1000.0 + t, 2.0) for t in range(5000)])
    conn.executemany("INSERT INTO status (rank_id, ts) VALUES (?, ?)", [(1, 1049.0), (2, 5999.0)])
    rows = samples.newest(conn, "system", "ts", 1, 120)
    assert [r[0] for r in rows] == [1049.0 - i for i in range(50)]  # all it has, though 5000 s old


def test_the_search_is_bounded_for_a_rank_without_samples(tmp_path: Path) -> None:
    conn = _db(tmp_path)
    conn.executemany("INSERT INTO gpu (rank_id, ts, gpu_index) VALUES (?, ?, ?)",
                     [(1, 1000.0 + t, 0) for t in range(10)])
    conn.execute("INSERT INTO status (rank_id, ts) VALUES (2, 1009.0)")
    queries: list[str] = []
    conn.set_trace_callback(queries.append)
    assert samples.newest(conn, "gpu", "ts", 2, 10) == []  # rank 2 is not its node's sampler
    searched = [q for q in queries if "FROM gpu" in q]
    assert len(searched) == -(-int(samples.SPAN_S // SAMPLE_SLICE_S) // samples.SLICES_PER_QUERY)
    assert samples.newest(conn, "gpu", "ts", 1, 0) == []
    with pytest.raises(ValueError, match="host-sample table"):
        samples.newest(conn, "steps", "ts", 1, 1)
