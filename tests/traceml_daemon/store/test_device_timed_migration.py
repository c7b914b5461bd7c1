"""Schema v13: steps gain device_timed, rows and rowids kept, old rows NULL."""

from __future__ import annotations

from pathlib import Path

from tests.traceml_daemon.history_support import ro
from tests.traceml_daemon.store.test_migrations import _database_at
from traceml_daemon.store.migrate import migrate
from traceml_daemon.store.migrations.v13_device_timed import V13_STEPS
from traceml_daemon.store.schema import RANK_GROUP, SCHEMA_VERSION
from traceml_wire.tables import columns


def test_v12_steps_gain_device_timed_keeping_rows_rowids_and_the_index(tmp_path: Path) -> None:
    db = tmp_path / "v12.db"
    conn = _database_at(db, 12)
    # MIGRATIONS[0] makes today's wire tables: put back steps as v12 had it.
    names = ", ".join(col.split()[0] for col in V13_STEPS.split(", "))
    conn.execute(f"CREATE TABLE steps_v12 (rank_id INTEGER NOT NULL, {V13_STEPS})")
    conn.execute(f"INSERT INTO steps_v12 (rowid, rank_id, {names}) SELECT rowid, rank_id, {names} FROM steps")
    conn.execute("DROP TABLE steps")
    conn.execute("ALTER TABLE steps_v12 RENAME TO steps")
    conn.execute(f"CREATE INDEX steps_by_group ON steps (rank_id / {RANK_GROUP}, step, rank_id)")
    conn.execute("DELETE FROM steps WHERE step % 3 = 1")  # rowids with gaps: kept as they are
    before = conn.execute("SELECT rowid, rank_id, step, step_ns, forward_ns FROM steps ORDER BY rowid").fetchall()
    assert before
    conn.close()
    assert migrate(str(db)) == SCHEMA_VERSION
    conn = ro(db)
    try:
        assert [row[1] for row in conn.execute("PRAGMA table_info(steps)")] == ["rank_id", *columns("steps")]
        assert conn.execute("SELECT rowid, rank_id, step, step_ns, forward_ns FROM steps ORDER BY rowid").fetchall() \
            == before
        assert conn.execute("SELECT count(*) FROM steps WHERE device_timed IS NOT NULL").fetchone()[0] == 0
        indexes = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE tbl_name='steps' AND type='index'")}
        assert indexes == {"steps_by_group"}
    finally:
        conn.close()


def test_a_fresh_database_has_device_timed_in_wire_order(tmp_path: Path) -> None:
    db = tmp_path / "fresh.db"
    assert migrate(str(db)) == SCHEMA_VERSION
    conn = ro(db)
    try:
        assert [row[1] for row in conn.execute("PRAGMA table_info(steps)")] == ["rank_id", *columns("steps")]
    finally:
        conn.close()
