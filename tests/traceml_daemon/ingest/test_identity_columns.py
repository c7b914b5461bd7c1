"""The daemon's ranks rows and columns, derived from traceml_wire/identity.py.

A sender's identity comes from its hello (``peers``) and its relay's node map,
never from parsing its sender id; a sender with no identity is still stored,
with NULL identity columns, and counted. Databases of schema v5 (with the
hand-written columns and ``run_id``) migrate to exactly the derived columns.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
from pathlib import Path
from typing import Any

from tests.traceml_daemon.wire_client import RELAY, steps_body
from traceml_daemon.ingest.decode import RANK_COLUMNS as DECODE_RANK_COLUMNS
from traceml_daemon.ingest.decode import Ingestor, Plan
from traceml_daemon.ingest.pipeline import StoreWriter, WorkItem
from traceml_daemon.store import reader
from traceml_daemon.store.migrate import migrate
from traceml_daemon.store.migrations import MIGRATIONS
from traceml_daemon.store.schema import RANK_COLUMNS, SCHEMA_VERSION
from traceml_wire.identity import IDENTITY_NAMES, MAX_CHARS, clean_identity

NODE = {"node_rank": 1, "hostname": "relay-host"}
FULL: dict[str, Any] = {
    "session": "job", "attempt": 0, "global_rank": 2, "local_rank": 0, "node_rank": 1, "world_size": 4,
    "local_world_size": 2, "nnodes": 2, "hostname": "gpu-b", "pid": 4242, "parallelism": "ddp", "device": "cpu",
}  # fmt: skip


def staged_rows(
    peers: dict[str, dict[str, Any]], senders: list[str], session: str | None = "relay-session",
    node: dict[str, Any] | None = None, ingestor: Ingestor | None = None,
) -> tuple[Plan, dict[str, dict[str, Any]]]:
    """Stage one rbatch with a batch per sender; each sender's ranks row by column."""
    plan = Plan()
    ing = ingestor or Ingestor()
    items: list[list[Any]] = [[s, ing.last_seq(s) + 1, steps_body(0, 2)] for s in senders]
    ing.stage(plan, relay_sender=RELAY, session=session, items=items, peers=peers, node=NODE if node is None else node,
              stats={}, now=5.0)
    ing.staged(plan)
    ing.commit(plan)
    return plan, {s: dict(zip(RANK_COLUMNS, row, strict=True)) for s, row in plan.ranks.items()}


def identity_of(row: dict[str, Any]) -> dict[str, Any]:
    return {name: row[name] for name in IDENTITY_NAMES}


def test_rank_columns_are_the_declared_identity_between_the_key_and_the_bookkeeping() -> None:
    assert RANK_COLUMNS == ("rank_id", "sender", *IDENTITY_NAMES, "first_seen", "last_seen", "last_seq")
    assert DECODE_RANK_COLUMNS is RANK_COLUMNS  # what the writer's upsert names (ingest/pipeline.py)
    assert "run_id" not in RANK_COLUMNS
    # The readers' row is the same list, in the same order (it is built positionally).
    assert tuple(f.name for f in dataclasses.fields(reader.RankRow)) == RANK_COLUMNS


def test_identity_comes_from_the_hello_whatever_the_sender_id_says() -> None:
    lying = "job/a3/n5/r9/1-aa"  # the old sender-id shape, stating attempt 3, node 5, rank 9
    foreign = "trainer-7@gpu-b"  # no shape at all
    _, rows = staged_rows({lying: FULL, foreign: {**FULL, "global_rank": 3, "pid": 77}}, [lying, foreign])
    assert identity_of(rows[lying]) == FULL
    assert identity_of(rows[foreign]) == {**FULL, "global_rank": 3, "pid": 77}


def test_a_sender_without_identity_is_stored_with_null_identity_and_counted() -> None:
    ing = Ingestor()
    plan, rows = staged_rows({}, ["s/a2/n7/r5/1-aa"], ingestor=ing)
    row = rows["s/a2/n7/r5/1-aa"]
    # Node fields from the relay's node map; the run from the relay's hello; the rest NULL
    # (attempt 0: the keys readers select runs by are never NULL). Nothing from the id.
    assert identity_of(row) == {**dict.fromkeys(IDENTITY_NAMES), "session": "relay-session", "attempt": 0,
                                "node_rank": 1, "hostname": "relay-host"}
    assert plan.rows_stored == 2 and plan.senders_without_identity == 1 and plan.identity_fields_refused == 0
    # Counted once per sender, not once per batch.
    again, _ = staged_rows({}, ["s/a2/n7/r5/1-aa"], ingestor=ing)
    assert again.senders_without_identity == 0 and again.rows_stored == 2


def test_no_session_anywhere_stores_the_declared_default() -> None:
    _, rows = staged_rows({"x": {"global_rank": 0}}, ["x"], session=None, node={})
    assert (rows["x"]["session"], rows["x"]["attempt"], rows["x"]["node_rank"]) == ("unknown", 0, None)


def test_the_hellos_session_stands_in_cut_to_the_declared_bound() -> None:
    _, rows = staged_rows({"x": {"global_rank": 0}}, ["x"], session="s" * 5000)
    assert rows["x"]["session"] == "s" * MAX_CHARS


def test_the_ranks_own_node_fields_win_over_the_relays() -> None:
    _, rows = staged_rows({"x": {"node_rank": 0, "hostname": "own"}}, ["x"], node={"node_rank": 3, "hostname": "r"})
    assert (rows["x"]["node_rank"], rows["x"]["hostname"]) == (0, "own")


def test_refused_fields_are_counted_and_never_reach_a_row() -> None:
    # What validation hands over (a CleanIdentity naming what it dropped) ...
    cleaned = clean_identity({**FULL, "pid": 2**63, "world_size": 0})
    plan, rows = staged_rows({"a": cleaned}, ["a"])
    assert rows["a"]["pid"] is None and rows["a"]["world_size"] is None
    assert plan.identity_fields_refused == 2 and plan.senders_without_identity == 0
    # ... and a map that skipped validation (a caller's own) is checked here, before SQLite.
    plan, rows = staged_rows({"b": {**FULL, "pid": 2**63, "node_rank": -1, "run_id": "x"}}, ["b"])
    assert rows["b"]["pid"] is None and rows["b"]["node_rank"] == NODE["node_rank"]
    assert plan.identity_fields_refused == 2


def test_an_older_agents_run_id_is_stored_as_the_session() -> None:
    old = {k: v for k, v in FULL.items() if k != "session"} | {"run_id": "old-job"}
    _, rows = staged_rows({"a": old}, ["a"])
    assert rows["a"]["session"] == "old-job"


# ---------------------------------------------------------------- storage


def _ranks_columns(conn: sqlite3.Connection) -> tuple[str, ...]:
    return tuple(row[1] for row in conn.execute("PRAGMA table_info(ranks)"))


def _v5_database(db: Path) -> None:
    """What traceml-daemon at schema 5 left: hand-written ranks columns, run_id beside session."""
    conn = sqlite3.connect(db, isolation_level=None)
    for statements in MIGRATIONS[:5]:
        for statement in statements:
            conn.execute(statement)
    conn.execute("INSERT INTO meta VALUES ('schema_version', '5')")
    conn.executemany(
        "INSERT INTO ranks (rank_id, sender, session, attempt, global_rank, local_rank, node_rank, world_size, "
        "local_world_size, nnodes, hostname, pid, run_id, parallelism, device, first_seen, last_seen, last_seq) "
        "VALUES (?, ?, 'job', 1, ?, ?, ?, 4, 2, 2, ?, ?, 'job', 'ddp', 'cpu', 1.0, 2.0, 3)",
        [(7, "job/a1/n0/r0/1-aa", 0, 0, 0, "h0", 100), (9, "job/a1/n1/r2/1-bb", 2, 0, 1, "h1", None)],
    )
    conn.execute("INSERT INTO steps (rank_id, step, ts, step_ns) VALUES (9, 0, 1.0, 5)")
    conn.close()


def test_fresh_and_v5_databases_end_with_exactly_the_rank_columns(tmp_path: Path) -> None:
    fresh, old = tmp_path / "fresh.db", tmp_path / "v5.db"
    assert migrate(str(fresh)) == SCHEMA_VERSION
    _v5_database(old)
    assert migrate(str(old)) == SCHEMA_VERSION
    for db in (fresh, old):
        conn = sqlite3.connect(db)
        assert _ranks_columns(conn) == RANK_COLUMNS
        indexes = {r[0]: r[1] for r in conn.execute("SELECT name, sql FROM sqlite_master WHERE tbl_name='ranks'")}
        assert "ranks_by_node" in indexes
        conn.close()
    conn = sqlite3.connect(old)
    # Every row kept, under its rank id (steps point at it), with every identity value.
    assert conn.execute("SELECT rank_id, sender, session, attempt, global_rank, node_rank, hostname, pid, last_seq "
                        "FROM ranks ORDER BY rank_id").fetchall() == [
        (7, "job/a1/n0/r0/1-aa", "job", 1, 0, 0, "h0", 100, 3), (9, "job/a1/n1/r2/1-bb", "job", 1, 2, 1, "h1", None, 3)
    ]
    conn.close()
    ro = reader.open_readonly(str(old))
    run = reader.latest_run(ro)
    assert run == reader.RunRef("job", 1)
    assert [(r.rank_id, r.global_rank, r.pid) for r in reader.load_ranks(ro, run)] == [(7, 0, 100), (9, 2, None)]
    ro.close()


def test_the_writer_carries_on_in_a_migrated_v5_database(tmp_path: Path) -> None:
    db = tmp_path / "v5.db"
    _v5_database(db)
    known = "job/a1/n1/r2/1-bb"

    async def go() -> None:
        writer = StoreWriter(str(db))  # migrates on open
        await writer.open()
        peers = {known: {**FULL, "global_rank": 2, "attempt": 1, "pid": 555}, "new-sender": {**FULL, "pid": 2**63}}
        items: list[list[Any]] = [[known, 4, steps_body(1, 2)], [known, 3, steps_body(9, 1)],
                                  ["new-sender", 1, steps_body(0, 2)]]
        assert await writer.write([WorkItem(RELAY, "job", 1, items, peers, NODE, {})])
        await writer.close()

    asyncio.run(go())
    conn = sqlite3.connect(db)
    rows = {r[0]: r[1:] for r in conn.execute("SELECT sender, rank_id, session, attempt, pid, last_seq FROM ranks")}
    # The known sender keeps its rank id and its dedup mark (seq 3 was a duplicate).
    assert rows[known] == (9, "job", 1, 555, 4)
    assert rows["new-sender"][1:] == ("job", 0, None, 1) and rows["new-sender"][0] > 9
    assert conn.execute("SELECT count(*) FROM steps WHERE rank_id=9").fetchone() == (3,)
    conn.close()
