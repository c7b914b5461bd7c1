"""Schema v11: the fingerprints table and its index, on a migrated database and a fresh one."""

from __future__ import annotations

from pathlib import Path

from tests.traceml_daemon.history_support import ro
from tests.traceml_daemon.store.test_migrations import _database_at
from traceml_daemon.store.migrate import migrate
from traceml_daemon.store.migrations import MIGRATIONS
from traceml_daemon.store.schema import SCHEMA_VERSION
from traceml_wire.tables import columns


def _shape(db: Path) -> tuple[list[str], set[str]]:
    conn = ro(db)
    try:
        cols = [row[1] for row in conn.execute("PRAGMA table_info(fingerprints)")]
        indexes = {r[0] for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE tbl_name = 'fingerprints' AND type = 'index'")}
    finally:
        conn.close()
    return cols, indexes


def test_v10_gains_the_fingerprints_table_and_its_index(tmp_path: Path) -> None:
    db = tmp_path / "v10.db"
    conn = _database_at(db, 10)
    conn.execute("DROP TABLE fingerprints")  # MIGRATIONS[0] makes today's wire tables: v10 had none
    conn.close()
    assert migrate(str(db)) == SCHEMA_VERSION
    assert _shape(db) == (["rank_id", *columns("fingerprints")], {"fingerprints_by_group"})


def test_a_fresh_database_has_the_fingerprints_table_in_wire_order(tmp_path: Path) -> None:
    db = tmp_path / "fresh.db"
    assert migrate(str(db)) == SCHEMA_VERSION
    assert _shape(db) == (["rank_id", *columns("fingerprints")], {"fingerprints_by_group"})


def test_v11_gains_param_sum_keeping_rows_and_the_index(tmp_path: Path) -> None:
    db = tmp_path / "v11.db"
    conn = _database_at(db, 11)
    conn.execute("DROP TABLE fingerprints")  # as v11 made it: without param_sum
    for statement in MIGRATIONS[10]:
        conn.execute(statement)
    conn.execute("INSERT INTO fingerprints (rank_id, step, model_id, idx, layer, param_norm, grad_norm, "
                 "grad_nonfinite, shard) VALUES (1, 7, 0, 2, 'fc.weight', 1.5, 0.25, 0, 0)")
    conn.close()
    assert migrate(str(db)) == SCHEMA_VERSION
    assert _shape(db) == (["rank_id", *columns("fingerprints")], {"fingerprints_by_group"})
    conn = ro(db)
    try:
        rows = conn.execute("SELECT rank_id, step, idx, layer, param_norm, grad_norm, param_sum "
                            "FROM fingerprints").fetchall()
    finally:
        conn.close()
    assert rows == [(1, 7, 2, "fc.weight", 1.5, 0.25, None)]  # an old row: no bit sum taken
