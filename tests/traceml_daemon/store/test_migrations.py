"""Older databases migrate forward: a v1 database (no history tables) gets its
history backfilled from raw steps, a v2 database keeps every history row under
the v3 keys, a v3 database trades its per-rank indexes for per-group ones (v4),
a v4 reservoir keeps its samples at the size they had (v5), and the writer
carries on where it stopped."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

from tests.traceml_daemon.history_support import batch, raw_buckets, ro, stored_buckets
from traceml_daemon.ingest.pipeline import StoreWriter
from traceml_daemon.store.migrate import migrate
from traceml_daemon.store.migrations import MIGRATIONS
from traceml_daemon.store.migrations.v10_fsdp2 import V10_TABLES
from traceml_daemon.store.reader import latest_run, load_rank_data, load_ranks
from traceml_daemon.store.schema import GROUPED_INDEXES, HISTORY_LEVELS, LATEST_SLOT, RANK_GROUP, SCHEMA_VERSION
from traceml_wire.tables import columns


def _v1_database(db: Path) -> None:
    """What traceml-daemon 1 wrote: the v1 schema, version 1, and some steps."""
    conn = sqlite3.connect(db, isolation_level=None)
    for statement in MIGRATIONS[0]:
        conn.execute(statement)
    conn.execute("INSERT INTO meta VALUES ('schema_version', '1')")
    for rank in (0, 1, 2):
        conn.execute(
            "INSERT INTO ranks (rank_id, sender, session, attempt, global_rank, node_rank, last_seq) "
            "VALUES (?, ?, 's1', 0, ?, ?, 1)",
            (rank + 1, f"s1/a0/n{rank // 2}/r{rank}/1000-abcd", rank, rank // 2),
        )
        conn.executemany(
            "INSERT INTO steps (rank_id, step, ts, step_ns, forward_ns) VALUES (?, ?, ?, ?, ?)",
            [(rank + 1, s, 1e9 + s, 1_000_000 + (s * 7919 + rank) % 5000, None if s % 3 else s) for s in range(1500)],
        )
    conn.close()


def _database_at(db: Path, version: int) -> sqlite3.Connection:
    """The v1 database as traceml-daemon ``version`` left it: migrated by exactly the
    steps that version ran. Returns an open connection, for rows of that version."""
    _v1_database(db)
    conn = sqlite3.connect(db, isolation_level=None)
    for statements in MIGRATIONS[1:version]:
        for statement in statements:
            conn.execute(statement)
    conn.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(version),))
    return conn


def test_v1_migrates_to_the_current_version_with_history_backfilled(tmp_path: Path) -> None:
    db = tmp_path / "v1.db"
    _v1_database(db)
    assert migrate(str(db)) == SCHEMA_VERSION
    conn = ro(db)
    assert conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
    for level in HISTORY_LEVELS:
        assert stored_buckets(conn, level) == raw_buckets(conn, level)
    latest = conn.execute("SELECT rank_id, step FROM reservoir WHERE slot=? ORDER BY rank_id", (LATEST_SLOT,))
    assert latest.fetchall() == [(1, 1499), (2, 1499), (3, 1499)]
    assert conn.execute("SELECT count(*) FROM reservoir WHERE rank_id=1 AND slot>=0").fetchone()[0] == 256
    assert conn.execute("SELECT sum(n) FROM node_history WHERE level=64").fetchone()[0] == 4500
    conn.close()


def test_writer_continues_a_migrated_database(tmp_path: Path) -> None:
    db = tmp_path / "v1.db"
    _v1_database(db)

    async def go() -> None:
        writer = StoreWriter(str(db))  # migrates on open
        await writer.open()
        assert await writer.write([batch(2, [0, 1, 2], 1500, 600)])
        await writer.close()

    asyncio.run(go())
    conn = ro(db)
    for level in HISTORY_LEVELS:
        assert stored_buckets(conn, level) == raw_buckets(conn, level)
    assert conn.execute("SELECT step FROM reservoir WHERE rank_id=1 AND slot=?", (LATEST_SLOT,)).fetchone() == (2099,)
    assert conn.execute("SELECT seen FROM reservoir_state WHERE rank_id=1").fetchone() == (2100,)


def _columns(conn: sqlite3.Connection, table: str) -> list[str]:
    return sorted(row[1] for row in conn.execute(f"PRAGMA table_info({table})"))


def _dump(conn: sqlite3.Connection, table: str, cols: list[str] | None = None) -> list[tuple[object, ...]]:
    """Every row of ``table`` (``cols``, default all), in a fixed order."""
    return sorted(conn.execute(f"SELECT {', '.join(cols or _columns(conn, table))} FROM {table}").fetchall(), key=repr)


def test_v2_history_keeps_every_row_under_the_v3_keys(tmp_path: Path) -> None:
    db = tmp_path / "v2.db"
    conn = _database_at(db, 2)
    # v2 appended a status row per flush; out of ts order once (a resend).
    conn.executemany(
        "INSERT INTO status (rank_id, ts, phase, steps_done, finished) VALUES (?, ?, ?, ?, ?)",
        [(1, 10.0, "forward", 1, 0), (1, 12.0, "idle", 3, 1), (1, 11.0, "backward", 2, 0), (2, 10.0, "wait", 1, 0)],
    )
    tables = ("rank_history", "node_history", "reservoir", "reservoir_state")
    columns = {t: _columns(conn, t) for t in tables}
    before = {t: _dump(conn, t) for t in tables}
    conn.close()
    assert all(before.values())
    assert migrate(str(db)) == SCHEMA_VERSION
    conn = ro(db)
    # Every row and value kept (v5 adds a column to reservoir_state, not compared here).
    assert {t: _dump(conn, t, columns[t]) for t in tables} == before
    keys = {
        t: [r[2] for r in sorted(conn.execute(f"PRAGMA index_xinfo('sqlite_autoindex_{t}_1')")) if r[5]]
        for t in ("rank_history", "node_history", "reservoir")
    }
    assert keys == {
        "rank_history": ["level", "bucket", "rank_id"],
        "node_history": ["session", "attempt", "level", "bucket", "node_rank"],
        "reservoir": ["slot", "rank_id"],
    }
    # status: each rank's newest row only, and one row per rank from now on.
    assert conn.execute("SELECT rank_id, ts, phase, finished FROM status ORDER BY rank_id").fetchall() == [
        (1, 12.0, "idle", 1), (2, 10.0, "wait", 0)
    ]
    unique = [r for r in conn.execute("PRAGMA index_list('status')") if r[2]]
    assert [(r[1], [c[2] for c in conn.execute(f"PRAGMA index_info('{r[1]}')")]) for r in unique] == [
        ("status_one_per_rank", ["rank_id"])
    ]
    conn.close()


def test_v3_per_rank_indexes_become_per_group_and_reads_are_unchanged(tmp_path: Path) -> None:
    db = tmp_path / "v3.db"
    _database_at(db, 3).close()
    conn = ro(db)
    run = latest_run(conn)
    assert run is not None
    before = {r.rank_id: load_rank_data(conn, r).step_ns for r in load_ranks(conn, run)}
    steps_before = _dump(conn, "steps")
    conn.close()
    assert migrate(str(db)) == SCHEMA_VERSION
    conn = ro(db)
    indexes = {name: table for name, table in conn.execute("SELECT name, tbl_name FROM sqlite_master WHERE type='index'")}
    for table, order in GROUPED_INDEXES.items():
        assert f"{table}_by_rank" not in indexes
        assert indexes[f"{table}_by_group"] == table
        columns = [row[2] for row in conn.execute(f"PRAGMA index_xinfo('{table}_by_group')") if row[5]]
        # An expression column has no name: (rank_id / RANK_GROUP, *order, rank_id).
        assert columns == [None, *order.split(", "), "rank_id"]
    assert f"/ {RANK_GROUP}" in conn.execute("SELECT sql FROM sqlite_master WHERE name='steps_by_group'").fetchone()[0]
    assert _dump(conn, "steps") == steps_before
    assert {r.rank_id: load_rank_data(conn, r).step_ns for r in load_ranks(conn, run)} == before
    assert all(len(v) == 1500 for v in before.values())
    conn.close()


def test_v4_samples_keep_their_size_and_new_ranks_of_a_big_job_get_smaller_ones(tmp_path: Path) -> None:
    db = tmp_path / "v4.db"
    conn = _database_at(db, 4)
    state_before = conn.execute("SELECT rank_id, seen, next_take, w FROM reservoir_state ORDER BY rank_id").fetchall()
    conn.close()
    assert migrate(str(db)) == SCHEMA_VERSION
    conn = ro(db)
    after = conn.execute("SELECT rank_id, seen, next_take, w, size FROM reservoir_state ORDER BY rank_id").fetchall()
    assert after == [(*row, 256) for row in state_before]
    conn.close()

    async def go() -> None:
        writer = StoreWriter(str(db))
        await writer.open()
        # Ranks 0-2 were sampled at 256 before v5; rank 5 is new and states a 4096-rank job.
        assert await writer.write([batch(2, [0, 1, 2, 5], 1500, 3000, world_size=4096)])
        await writer.close()

    asyncio.run(go())
    conn = ro(db)
    sizes = dict(conn.execute("SELECT rank_id, size FROM reservoir_state").fetchall())
    assert sizes == {1: 256, 2: 256, 3: 256, 4: 64}
    counts = dict(conn.execute("SELECT rank_id, count(*) FROM reservoir WHERE slot >= 0 GROUP BY rank_id").fetchall())
    assert counts == {1: 256, 2: 256, 3: 256, 4: 64}
    conn.close()


def test_v7_gains_the_output_table_and_its_index(tmp_path: Path) -> None:
    db = tmp_path / "v7.db"
    conn = _database_at(db, 7)
    # MIGRATIONS[0] creates every wire table of today: take away what v7 did not have.
    conn.execute("DROP TABLE output")
    conn.close()
    assert migrate(str(db)) == SCHEMA_VERSION
    conn = ro(db)
    cols = [row[1] for row in conn.execute("PRAGMA table_info(output)")]
    assert cols == ["rank_id", "ts", "stream", "seq", "line"]
    indexes = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE tbl_name='output' AND type='index'")}
    assert indexes == {"output_by_group"}
    conn.close()


def test_v8_spans_gain_lanes_and_keep_their_rows_and_session_tables_appear(tmp_path: Path) -> None:
    db = tmp_path / "v8.db"
    conn = _database_at(db, 8)
    # MIGRATIONS[0] creates every wire table of today: put back what v8 had.
    for table in ("spans", "rollout_sessions", "session_phases", "profiles"):
        conn.execute(f"DROP TABLE {table}")
    conn.execute("CREATE TABLE spans (rank_id INTEGER NOT NULL, name TEXT, start_ns INTEGER, dur_ns INTEGER, "
                 "step INTEGER, args TEXT)")
    conn.execute("INSERT INTO spans VALUES (1, 'eval', 5, 7, 3, '{}'), (2, 'mark', 9, NULL, NULL, NULL)")
    conn.close()
    assert migrate(str(db)) == SCHEMA_VERSION
    conn = ro(db)
    cols = [row[1] for row in conn.execute("PRAGMA table_info(spans)")]
    assert cols == ["rank_id", "name", "start_ns", "dur_ns", "step", "args", "category", "lane", "span_id",
                    "parent_id"]
    rows = conn.execute("SELECT * FROM spans ORDER BY rank_id").fetchall()
    assert rows == [(1, "eval", 5, 7, 3, "{}", None, None, None, None),
                    (2, "mark", 9, None, None, None, None, None, None, None)]
    indexes = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert {"spans_by_group", "rollout_sessions_by_group", "session_phases_by_group", "profiles_by_rank"} <= indexes
    assert [r[1] for r in conn.execute("PRAGMA table_info(rollout_sessions)")][:3] == ["rank_id", "task_id",
                                                                                        "session_id"]
    conn.close()


def test_a_fresh_database_reaches_v9_with_the_new_span_columns(tmp_path: Path) -> None:
    db = tmp_path / "fresh.db"
    assert migrate(str(db)) == SCHEMA_VERSION
    conn = ro(db)
    assert "parent_id" in [row[1] for row in conn.execute("PRAGMA table_info(spans)")]
    conn.close()


def test_v9_steps_and_models_gain_the_fsdp2_columns_keeping_rows_and_rowids(tmp_path: Path) -> None:
    db = tmp_path / "v9.db"
    conn = _database_at(db, 9)
    # MIGRATIONS[0] makes today's wire tables: put back steps and models as v9 had them.
    for table, (old, _) in V10_TABLES.items():
        names = ", ".join(col.split()[0] for col in old.split(", "))
        conn.execute(f"CREATE TABLE {table}_v9 (rank_id INTEGER NOT NULL, {old})")
        conn.execute(f"INSERT INTO {table}_v9 (rowid, rank_id, {names}) SELECT rowid, rank_id, {names} FROM {table}")
        conn.execute(f"DROP TABLE {table}")
        conn.execute(f"ALTER TABLE {table}_v9 RENAME TO {table}")
    conn.execute(f"CREATE INDEX steps_by_group ON steps (rank_id / {RANK_GROUP}, step, rank_id)")
    conn.execute("INSERT INTO models (rank_id, model_id, name, parallelism) VALUES (1, 0, 'Net', 'fsdp2')")
    conn.execute("DELETE FROM steps WHERE step % 2 = 1")  # rowids with gaps: kept as they are
    before = conn.execute("SELECT rowid, rank_id, step, step_ns, forward_ns FROM steps ORDER BY rowid").fetchall()
    conn.close()
    assert migrate(str(db)) == SCHEMA_VERSION
    conn = ro(db)
    for table in ("steps", "models"):
        assert [row[1] for row in conn.execute(f"PRAGMA table_info({table})")] == ["rank_id", *columns(table)]
    assert conn.execute("SELECT rowid, rank_id, step, step_ns, forward_ns FROM steps ORDER BY rowid").fetchall() == before
    assert conn.execute("SELECT count(*) FROM steps WHERE fwd_comm_ns IS NOT NULL OR bwd_comm_ns IS NOT NULL "
                        "OR replicate_comm_ns IS NOT NULL OR post_forward_bytes IS NOT NULL").fetchone()[0] == 0
    assert conn.execute("SELECT shard_degree, replicate_degree, name FROM models").fetchall() == [(None, None, "Net")]
    indexes = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE tbl_name IN ('steps', 'models') "
                                          "AND type='index'")}
    assert indexes == {"steps_by_group", "models_by_rank"}
    conn.close()


def test_a_fresh_database_has_the_fsdp2_columns_in_wire_order(tmp_path: Path) -> None:
    db = tmp_path / "fresh.db"
    assert migrate(str(db)) == SCHEMA_VERSION
    conn = ro(db)
    for table in ("steps", "models"):
        assert [row[1] for row in conn.execute(f"PRAGMA table_info({table})")] == ["rank_id", *columns(table)]
    conn.close()
