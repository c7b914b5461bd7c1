"""Writer, migrations, reader and live aggregates against a real SQLite file."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from tests.traceml_daemon.ingest.faults import failing_inserts
from tests.traceml_daemon.wire_client import RELAY, agent_sender, steps_body
from traceml_daemon.ingest.live import Aggregates
from traceml_daemon.ingest.pipeline import StoreWriter, WorkItem
from traceml_daemon.net.inbound import ByteQueue
from traceml_daemon.store import reader
from traceml_daemon.store.migrate import SchemaError, migrate
from traceml_daemon.store.schema import SCHEMA_VERSION
from traceml_wire.body import encode_body

A0, A1 = agent_sender("s1", 0), agent_sender("s1", 1, node=1)
# A1 states its node (1) in its hello; A0 leaves it to its relay's node map.
PEERS = {A0: {"global_rank": 0, "local_rank": 0, "world_size": 2},
         A1: {"global_rank": 1, "local_rank": 0, "node_rank": 1}}


def item(seq: int, items: list[list[object]], stats: dict[str, int] | None = None, node: int = 0) -> WorkItem:
    return WorkItem(RELAY, "s1", seq, items, PEERS, {"node_rank": node, "hostname": f"h{node}"}, stats or {})


async def write_all(db: Path, *batches: list[WorkItem], aggregates: Aggregates | None = None) -> StoreWriter:
    writer = StoreWriter(str(db), aggregates=aggregates)
    await writer.open()
    for work in batches:
        assert await writer.write(work)
    await writer.close()
    return writer


def test_migrate_creates_schema_and_refuses_newer(tmp_path: Path) -> None:
    db = tmp_path / "x.db"
    assert migrate(str(db)) == SCHEMA_VERSION
    assert migrate(str(db)) == SCHEMA_VERSION  # idempotent
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION + 1),))
    conn.commit()
    conn.close()
    with pytest.raises(SchemaError, match="newer"):
        migrate(str(db))
    with pytest.raises(reader.StoreError, match="newer"):
        reader.open_readonly(str(db))


def test_foreign_database_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "other.db"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    with pytest.raises(SchemaError, match="not a traceml database"):
        migrate(str(db))
    with pytest.raises(reader.StoreError, match="not a traceml database"):
        reader.open_readonly(str(db))


def test_dedup_within_and_across_transactions_and_reopen(tmp_path: Path) -> None:
    db = tmp_path / "x.db"
    first = [item(1, [[A0, 1, steps_body(0, 3)], [A0, 1, steps_body(0, 3)], [A1, 1, steps_body(0, 3)]])]
    writer = asyncio.run(write_all(db, first, [item(2, [[A0, 1, steps_body(0, 3)], [A0, 2, steps_body(3, 3)]])]))
    assert writer.counters.rows_stored == 9
    assert writer.counters.duplicates_discarded == 2
    # A new writer on the same file knows the high-water marks from ranks.last_seq.
    writer = asyncio.run(write_all(db, [item(1, [[A0, 2, steps_body(3, 3)], [A1, 2, steps_body(3, 3)]])]))
    assert writer.counters.rows_stored == 12
    assert writer.counters.duplicates_discarded == 3
    conn = reader.open_readonly(str(db))
    run = reader.latest_run(conn)
    assert run == reader.RunRef("s1", 0)
    ranks = reader.load_ranks(conn, run)
    assert [(r.global_rank, r.node_rank, r.hostname, r.last_seq) for r in ranks] == [(0, 0, "h0", 2), (1, 1, "h0", 2)]
    data = reader.load_run(conn, run)
    assert [len(r.steps) for r in data.ranks] == [6, 6]
    assert data.ranks[0].phases_ns["forward"] == [6_000_000] * 6
    assert len(reader.load_run(conn, run, last_n=2).ranks[0].steps) == 2
    assert reader.delivery_counters(conn)["rows_stored"] == 12


def test_node_identity_comes_from_the_agent_before_the_relay(tmp_path: Path) -> None:
    db = tmp_path / "x.db"
    peers = {A0: {"global_rank": 0, "node_rank": 3}}
    work = WorkItem(RELAY, "s1", 1, [[A0, 1, steps_body(0, 1)]], peers, {"node_rank": 0, "hostname": "same"}, {})
    asyncio.run(write_all(db, [work]))
    conn = reader.open_readonly(str(db))
    (rank,) = reader.load_ranks(conn, reader.RunRef("s1", 0))
    assert (rank.node_rank, rank.hostname) == (3, "same")


def test_relay_stats_and_agent_drops_are_delivery_counters(tmp_path: Path) -> None:
    db = tmp_path / "x.db"
    # Every counter an agent reports (runtime, tracer, sender), each with a distinct value.
    reported = {
        "recorder_rows": 5,  # lost: the recorder's byte cap dropped them
        "steps_dropped": 7,  # lost: CPU steps the tracer's bounded queue discarded
        "scalars_dropped": 3,  # lost: lazy scalars never resolved
        "sender_oversize_rows": 1,  # lost: a row larger than any batch
        "device_steps_dropped": 11,  # stored with host timings: not a loss
        "device_steps_fallback": 13,  # stored with host timings
        "device_steps_overflow": 17,  # stored with host timings
        "sender_batches": 2,
        "agent_errors": 9,
    }
    drops = encode_body({"drops": {"ts": [1.0] * len(reported), "source": list(reported), "count": list(reported.values())}})
    older = encode_body({"drops": {"ts": [0.5, 0.5], "source": ["recorder_rows", "steps_dropped"], "count": [3, 1]}})
    asyncio.run(
        write_all(
            db,
            [item(1, [[A0, 1, drops]], stats={"dropped_batches": 4})],
            [item(2, [[A0, 2, older]], stats={"dropped_batches": 1})],  # counters never go back
        )
    )
    counters = reader.delivery_counters(reader.open_readonly(str(db)))
    assert counters["rows_dropped_reported"] == 5 + 7 + 3 + 1  # exactly the real losses
    assert counters["batches_dropped_reported"] == 2 + 4  # the agent's resend buffer + the relay
    assert counters["agent_agent_errors"] == 9
    assert counters["agent_device_steps_dropped"] == 11 and counters["agent_steps_dropped"] == 7
    assert counters["relay_dropped_batches"] == 4


def test_drops_rows_are_stored_when_a_counter_changes_not_when_it_repeats(tmp_path: Path) -> None:
    db = tmp_path / "x.db"

    def counters(ts: float, **values: int) -> bytes:
        return encode_body({"drops": {"ts": [ts] * len(values), "source": list(values), "count": list(values.values())}})

    writer = asyncio.run(
        write_all(
            db,
            [item(1, [[A0, 1, counters(1.0, recorder_rows=0, steps_dropped=0)],
                      [A0, 2, counters(2.0, recorder_rows=0, steps_dropped=0)]])],  # a repeat, same transaction
            [item(2, [[A0, 3, counters(3.0, recorder_rows=0, steps_dropped=0)],  # a repeat, next transaction
                      [A1, 1, counters(3.0, recorder_rows=0, steps_dropped=0)]])],  # another agent's first
            [item(3, [[A0, 4, counters(4.0, recorder_rows=0, steps_dropped=2)]])],  # one counter moved
        )
    )
    conn = sqlite3.connect(db)
    rows = conn.execute("SELECT r.global_rank, d.ts, d.source, d.count FROM drops d JOIN ranks r USING (rank_id) "
                        "ORDER BY d.ts, r.global_rank, d.source").fetchall()
    conn.close()
    assert rows == [
        (0, 1.0, "recorder_rows", 0), (0, 1.0, "steps_dropped", 0),
        (1, 3.0, "recorder_rows", 0), (1, 3.0, "steps_dropped", 0),
        (0, 4.0, "steps_dropped", 2),  # when the loss happened
    ]
    assert writer.counters.rows_stored == 5
    assert reader.delivery_counters(reader.open_readonly(str(db)))["agent_steps_dropped"] == 2


def test_a_failed_write_does_not_lose_the_drops_rows_of_its_resent_batches(tmp_path: Path) -> None:
    db = tmp_path / "x.db"
    # A real SQLite error inside the transaction while the flag is set, not the data's fault.
    conn = failing_inserts(db, "drops", kind="io")
    body = encode_body({"drops": {"ts": [1.0], "source": ["steps_dropped"], "count": [4]}})

    async def go() -> None:
        writer = StoreWriter(str(db))
        await writer.open()
        assert not await writer.write([item(1, [[A0, 1, body]])])  # not stored, not acknowledged
        conn.execute("UPDATE meta SET value='0' WHERE key='fail'")
        assert await writer.write([item(1, [[A0, 1, body]])])  # the relay resends it
        await writer.close()

    asyncio.run(go())
    assert conn.execute("SELECT source, count FROM drops").fetchall() == [("steps_dropped", 4)]
    conn.close()


def test_bad_body_is_counted_and_skipped_not_fatal(tmp_path: Path) -> None:
    db = tmp_path / "x.db"
    writer = asyncio.run(write_all(db, [item(1, [[A0, 1, b"\xc1garbage"], [A1, 1, steps_body(0, 2)]])]))
    assert writer.counters.bad_bodies == 1
    assert writer.counters.rows_stored == 2


def test_aggregates_track_rolling_medians_as_batches_commit(tmp_path: Path) -> None:
    aggregates = Aggregates(window=4)
    asyncio.run(
        write_all(
            tmp_path / "x.db",
            [item(1, [[A0, 1, steps_body(0, 10, step_ns=10_000_000)], [A1, 1, steps_body(0, 2)]])],
            [item(2, [[A0, 2, steps_body(10, 4, step_ns=30_000_000)]])],
            aggregates=aggregates,
        )
    )
    snap = {s.global_rank: s for s in aggregates.snapshot()}
    assert snap[0].step_ms_median == 30.0  # only the last 4 steps are in the window
    assert snap[0].steps_seen == 14 and snap[0].last_step == 13
    assert snap[1].step_ms_median == 20.0
    assert snap[1].phases_ms_median["backward"] == 9.0


def test_byte_queue_blocks_producers_until_the_writer_releases() -> None:
    async def scenario() -> list[str]:
        queue: ByteQueue[str] = ByteQueue(100)
        events: list[str] = []
        await queue.put("a", 60)

        async def producer() -> None:
            await queue.put("b", 60)
            events.append("b queued")

        task = asyncio.create_task(producer())
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        events.append("a taken")
        taken = await queue.get_many(1000, timeout=1)
        assert [x for x, _ in taken] == ["a"]
        await asyncio.sleep(0)
        assert not task.done()  # bytes stay accounted until released
        await queue.release(60)
        await task
        return events

    assert asyncio.run(scenario()) == ["a taken", "b queued"]


def test_integer_beyond_int64_is_a_bad_body_not_a_failed_transaction(tmp_path: Path) -> None:
    # sqlite3 raises OverflowError (not sqlite3.Error) binding it: before decode refused
    # it, it escaped the writer and ended the daemon.
    db = tmp_path / "x.db"
    huge = encode_body({"steps": {"step": [1], "step_ns": [2**64 - 1]}})
    writer = asyncio.run(write_all(db, [item(1, [[A0, 1, huge], [A1, 1, steps_body(0, 2)]])]))
    assert (writer.counters.bad_bodies, writer.counters.rows_stored) == (1, 2)


def _status_body(t: float, phase: str, steps_done: int, finished: int = 0) -> bytes:
    return encode_body({"status": {"ts": [t], "phase": [phase], "phase_since": [t], "step": [steps_done],
                                   "steps_done": [steps_done], "finished": [finished]}})


def test_status_keeps_each_ranks_newest_row_under_a_rising_rowid(tmp_path: Path) -> None:
    db = tmp_path / "st.db"
    # Two flushes of A0 in one transaction, one of A1, then A0's last word in another.
    asyncio.run(write_all(
        db,
        [item(1, [[A0, 1, _status_body(10.0, "forward", 1)], [A0, 2, _status_body(11.0, "backward", 2)],
                  [A1, 1, _status_body(10.5, "wait", 1)]])],
        [item(2, [[A0, 3, _status_body(12.0, "idle", 3, finished=1)]])],
    ))
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    rows = conn.execute("SELECT rowid, rank_id, ts, phase, steps_done, finished FROM status ORDER BY rank_id").fetchall()
    assert [r[1:] for r in rows] == [(1, 12.0, "idle", 3, 1), (2, 10.5, "wait", 1, 0)]
    # A reader tailing ``rowid > last`` (the TUI) sees the replacement as a new row,
    # also when the replaced row held the highest rowid (SQLite picks the new rowid
    # before it deletes the conflicting row).
    assert rows[0][0] > rows[1][0]
    conn.close()
    asyncio.run(write_all(db, [item(3, [[A0, 4, _status_body(13.0, "idle", 3, finished=1)]])]))
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    (rowid, ts), = conn.execute("SELECT rowid, ts FROM status WHERE rank_id=1").fetchall()
    assert rowid > rows[0][0] and ts == 13.0
    conn.close()
    conn = reader.open_readonly(str(db))
    data = reader.load_run(conn, reader.latest_run(conn))
    statuses = [r.status for r in data.ranks]
    assert [(st.phase, st.steps_done, st.finished) for st in statuses if st] == [("idle", 3, True), ("wait", 1, False)]


def test_writer_collects_garbage_on_its_timer_not_on_allocations(tmp_path: Path) -> None:
    """Automatic collection is off while the writer is open (ingest's allocations are
    freed by reference counting); a due timer collects cycles; close() restores it."""
    import gc
    import weakref

    from traceml_daemon.store.policy import IngestPolicy

    class Node:
        other: object = None

    async def run() -> None:
        writer = StoreWriter(str(tmp_path / "gc.db"), policy=IngestPolicy(gc_interval_s=3600.0))
        await writer.open()
        try:
            assert not gc.isenabled()
            a, b = Node(), Node()
            a.other, b.other = b, a  # a cycle: reference counting alone never frees it
            alive = weakref.ref(a)
            del a, b
            assert writer.maybe_collect_garbage() is None  # not due yet
            assert alive() is not None
            writer._next_gc = 0.0  # due
            assert writer.maybe_collect_garbage()
            assert alive() is None
        finally:
            await writer.close()
        assert gc.isenabled()

    assert gc.isenabled()
    asyncio.run(run())
