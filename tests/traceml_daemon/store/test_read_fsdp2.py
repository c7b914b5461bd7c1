"""store/read/fsdp2.py on a real SQLite file: FSDP2 step columns lined up with the steps a
reader loaded (all of them, or a long run's sample), and a database without the columns."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from traceml_daemon.analysis.model import RankData
from traceml_daemon.store.migrate import migrate
from traceml_daemon.store.read import fsdp2


def _db(tmp_path: Path, steps: range) -> sqlite3.Connection:
    db = tmp_path / "f.db"
    migrate(str(db))
    conn = sqlite3.connect(db)
    conn.executemany(
        "INSERT INTO steps (rank_id, step, step_ns, model_id, fwd_comm_ns, bwd_comm_ns, replicate_comm_ns) "
        "VALUES (1, ?, 1000, 0, ?, ?, NULL)",
        [(s, s * 10, None if s % 7 == 0 else s * 20) for s in steps],
    )
    # a second traced model's row of the same step: the first model's row stands for it
    conn.execute("INSERT INTO steps (rank_id, step, model_id, fwd_comm_ns) VALUES (1, 5, 1, -1)")
    conn.commit()
    return conn


def test_dense_steps_line_up_and_unmeasured_stay_none(tmp_path: Path) -> None:
    conn = _db(tmp_path, range(0, 50))
    data = RankData(global_rank=0, steps=list(range(3, 20)))
    fsdp2.fill_steps(conn, [(1, data)])
    assert data.fwd_comm_ns == [s * 10 for s in range(3, 20)]
    assert data.bwd_comm_ns == [None if s % 7 == 0 else s * 20 for s in range(3, 20)]
    assert data.replicate_comm_ns == [None] * 17 and data.post_forward_bytes == [None] * 17


def test_a_sample_of_a_long_run_reads_only_its_steps(tmp_path: Path) -> None:
    conn = _db(tmp_path, range(0, 20_000))
    sample = [*range(0, 19_000, 97), *range(19_990, 20_000), 25_000]  # 25,000: a step with no row
    data = RankData(global_rank=0, steps=sample)
    fsdp2.fill_steps(conn, [(1, data)])
    assert data.fwd_comm_ns == [s * 10 for s in sample[:-1]] + [None]


def test_a_database_without_the_columns_leaves_the_lists_alone(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / "old.db")
    conn.execute("CREATE TABLE steps (rank_id INTEGER, step INTEGER, step_ns INTEGER)")
    conn.execute("CREATE TABLE models (rank_id INTEGER, model_id INTEGER, parallelism TEXT, "
                 "local_shard_bytes INTEGER, estimated_full_bytes INTEGER)")
    conn.execute("INSERT INTO models VALUES (1, 0, 'fsdp2', 10, 20)")
    data = RankData(global_rank=0, steps=[1, 2])
    fsdp2.fill_steps(conn, [(1, data)])
    assert data.fwd_comm_ns == []
    assert fsdp2.model_facts(conn, 1) == {"local_shard_bytes": 10, "estimated_full_bytes": 20,
                                          "shard_degree": None, "replicate_degree": None}
