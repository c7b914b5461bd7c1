"""The cheap ingest path: coalesced acks, narrow ranks updates, the history
backlog and lazily folded aggregates keep the stored results unchanged."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.traceml_daemon.history_support import batch, raw_buckets, ro, stored_buckets
from tests.traceml_daemon.ingest.faults import failing_inserts
from tests.traceml_daemon.wire_client import RELAY, agent_sender
from traceml_daemon.ingest.live import FOLD_ROWS, Aggregates
from traceml_daemon.ingest.pipeline import StoreWriter, WorkItem
from traceml_daemon.ingest.ring import Ring
from traceml_daemon.net.acks import AckWriter
from traceml_daemon.net.inbound import ByteQueue
from traceml_daemon.store.policy import IngestPolicy
from traceml_daemon.store.schema import HISTORY_LEVELS
from traceml_wire import FrameDecoder, unpack_message
from traceml_wire.body import encode_body


class _FakeWriter:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def test_acks_of_one_pass_leave_in_one_write_in_order() -> None:
    async def scenario() -> _FakeWriter:
        fake = _FakeWriter()
        acks = AckWriter(fake)  # type: ignore[arg-type]
        for seq in (1, 2, 3):
            acks.ack(seq)
        assert fake.writes == []  # nothing before the end of this pass of the loop
        await asyncio.sleep(0)
        return fake

    fake = asyncio.run(scenario())
    assert len(fake.writes) == 1
    messages = [unpack_message(b) for b in FrameDecoder().feed(fake.writes[0])]
    assert [(m["t"], m["seq"]) for m in messages] == [("ack", 1), ("ack", 2), ("ack", 3)]


def test_failure_flushes_earlier_acks_then_closes() -> None:
    async def scenario() -> _FakeWriter:
        fake = _FakeWriter()
        acks = AckWriter(fake)  # type: ignore[arg-type]
        acks.ack(1)
        acks.fail()
        await asyncio.sleep(0)
        return fake

    fake = asyncio.run(scenario())
    assert fake.closed and len(fake.writes) == 1
    assert [unpack_message(b)["seq"] for b in FrameDecoder().feed(fake.writes[0])] == [1]


def _one(seq: int, hostname: str, first: int) -> WorkItem:
    sender = agent_sender("s1", 0, node=0)
    body = encode_body({"steps": {"step": list(range(first, first + 3)), "ts": [1.0, 2.0, 3.0],
                                  "step_ns": [5, 6, 7]}})
    peers = {sender: {"global_rank": 0, "node_rank": 0, "hostname": hostname, "world_size": 4}}
    return WorkItem(RELAY, "s1", seq, [[sender, seq, body]], peers, {}, {})


def test_ranks_row_keeps_identity_under_narrow_updates_and_takes_a_new_one(tmp_path: Path) -> None:
    db = tmp_path / "r.db"

    async def run() -> None:
        writer = StoreWriter(str(db))
        await writer.open()
        assert await writer.write([_one(1, "h0", 0)])
        assert await writer.write([_one(2, "h0", 3)])  # identity committed: narrow update
        assert await writer.write([_one(3, "h0", 6)])
        conn = ro(db)
        row = conn.execute("SELECT global_rank, world_size, hostname, last_seq, first_seen <= last_seen FROM ranks")
        assert row.fetchall() == [(0, 4, "h0", 3, 1)]
        conn.close()
        assert await writer.write([_one(4, "h1", 9)])  # a changed identity is written in full
        await writer.close()

    asyncio.run(run())
    conn = ro(db)
    assert conn.execute("SELECT hostname, last_seq FROM ranks").fetchall() == [("h1", 4)]
    assert conn.execute("SELECT count(*) FROM steps").fetchone()[0] == 12


def test_history_is_written_once_the_backlog_passes_its_bound(tmp_path: Path) -> None:
    db = tmp_path / "b.db"
    policy = IngestPolicy(history_interval=3600.0, history_backlog_rows=500)

    async def run() -> None:
        writer = StoreWriter(str(db), policy=policy)
        await writer.open()
        seq = 0
        for first in range(0, 1200, 100):  # 12 transactions of 3 ranks x 100 steps
            seq += 1
            assert await writer.write([batch(seq, [0, 1, 2], first, 100)])
            assert writer.history.backlog.rows < policy.history_backlog_rows + 300
        # Not closed: what the bound flushed is there without the final write.
        conn = ro(db)
        written = conn.execute("SELECT sum(n) FROM rank_history WHERE level=?", (HISTORY_LEVELS[0],)).fetchone()[0]
        assert written is not None and written >= 3 * 1200 - policy.history_backlog_rows - 300
        conn.close()
        await writer.close()

    asyncio.run(run())
    conn = ro(db)
    for level in HISTORY_LEVELS:
        assert stored_buckets(conn, level) == raw_buckets(conn, level), level


def test_history_backlog_bound_is_per_rank_with_many_ranks(tmp_path: Path) -> None:
    """With many ranks the per-rank bound, not the floor, makes a write due: the
    interval sets the pace of history writes (each rewrites every rank's buckets)."""
    db = tmp_path / "p.db"
    policy = IngestPolicy(history_interval=3600.0, history_backlog_rows=100, history_backlog_rows_per_rank=200)
    ranks = [0, 1, 2]  # bound: 3 x 200 = 600 rows, not 100

    async def run() -> None:
        writer = StoreWriter(str(db), policy=policy)
        await writer.open()
        assert await writer.write([batch(1, ranks, 0, 50)])
        assert await writer.write([batch(2, ranks, 50, 50)])  # the first write of history is due at once
        held = []
        for seq in range(3, 7):
            assert await writer.write([batch(seq, ranks, 50 * (seq - 1), 50)])
            held.append(writer.history.backlog.rows)
        assert held == [300, 450, 600, 150]  # folded and written once it reached 600
        await writer.close()

    asyncio.run(run())
    conn = ro(db)
    for level in HISTORY_LEVELS:
        assert stored_buckets(conn, level) == raw_buckets(conn, level), level


def test_aggregates_fold_unread_pushes_and_reads_see_every_step() -> None:
    agg = Aggregates(window=200)
    for i in range(100):  # 100 pushes of 3 steps, never read
        cols = {"step": [3 * i, 3 * i + 1, 3 * i + 2], "ts": [1.0, 2.0, float(i)], "step_ns": [10_000_000] * 3}
        agg.add_steps(1, cols, global_rank=0, node_rank=0)
        assert agg._ranks[1].pending_rows < FOLD_ROWS  # bounded without a reader
    snap = agg.snapshot()[0]
    assert (snap.steps_seen, snap.last_step, snap.last_ts, snap.step_ms_median) == (300, 299, 99.0, 10.0)


def test_ring_keeps_the_newest_values() -> None:
    ring = Ring(4)
    assert not ring and len(ring) == 0
    for chunk in ([1, 2], [3], [4, 5, 6], list(range(7, 20))):
        ring.extend(chunk)
    assert list(ring) == [16.0, 17.0, 18.0, 19.0] and len(ring) == 4


def test_int64_ring_clamps_instead_of_failing() -> None:
    ring = Ring(3, "q")
    ring.extend([1, 2])
    ring.extend([3, 2**64])  # array.extend raises part way: nothing half-added survives
    assert list(ring) == [2, 3, 2**63 - 1]


def test_multi_row_statements_insert_the_same_rows() -> None:
    import sqlite3

    from traceml_daemon.store.statements import multi_row

    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE t (a, b, c)")
    rows = [(i, f"x{i}", i / 2) for i in range(1500)]  # more than one statement's worth
    flat = [value for row in rows for value in row]  # row-major, as Ingestor stages them
    for sql, params in multi_row(("INSERT INTO t (a, b, c)", "", 3), flat, len(rows)):
        conn.execute(sql, params)
    assert conn.execute("SELECT a, b, c FROM t ORDER BY rowid").fetchall() == rows


def test_chunk_statements_insert_every_batch_row_in_order_across_statement_bounds() -> None:
    import sqlite3

    from traceml_daemon.store.statements import ROWS_PER_STATEMENT, chunk_statements

    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE t (rank_id, a, b, c)")
    # Batches smaller and larger than a statement, so statements start and end inside
    # batches and span several; tuples as decoded and a list (a filled column) alike.
    sizes = [1, ROWS_PER_STATEMENT - 3, 5, 2 * ROWS_PER_STATEMENT + 7, 2, ROWS_PER_STATEMENT]
    chunks: list[tuple[int, list]] = []
    expected: list[tuple] = []
    for rank_id, n in enumerate(sizes, 100):
        a = tuple(range(rank_id * 10_000, rank_id * 10_000 + n))
        b = [f"s{v}" for v in a]
        c = tuple(v / 4 if v % 3 else None for v in a)
        chunks.append((rank_id, [a, b, c]))
        expected += [(rank_id, *row) for row in zip(a, b, c, strict=True)]
    statements = chunk_statements(("INSERT INTO t (rank_id, a, b, c)", "", 4), chunks)
    assert len(statements) > len(sizes) // 2
    for sql, params in statements:
        conn.execute(sql, params)
    assert conn.execute("SELECT rank_id, a, b, c FROM t ORDER BY rowid").fetchall() == expected
    assert chunk_statements(("INSERT INTO t (rank_id, a, b, c)", "", 4), []) == []


def test_ring_skips_none_and_keeps_the_newest_measured_values() -> None:
    ring = Ring(3, "q")
    ring.extend([1, None, 2])
    ring.extend([None, 3, 4.0, None])
    assert list(ring) == [2, 3, 4]


@pytest.mark.parametrize("checkpointer", [True, False])
def test_writer_connection_takes_the_policy_cache_and_checkpoint_sizes(tmp_path: Path, checkpointer: bool) -> None:
    db = tmp_path / "p.db"
    interval = 0.1 if checkpointer else 0.0
    policy = IngestPolicy(sqlite_cache_kib=12_345, wal_autocheckpoint_pages=4321, checkpoint_interval_s=interval)

    async def run() -> tuple[int, int, int]:
        writer = StoreWriter(str(db), policy=policy)
        await writer.open()
        assert writer._db is not None
        async with writer._db.execute("PRAGMA cache_size") as cur:
            cache = (await cur.fetchone())[0]  # type: ignore[index]
        async with writer._db.execute("PRAGMA wal_autocheckpoint") as cur:
            checkpoint = (await cur.fetchone())[0]  # type: ignore[index]
        assert await writer.write([batch(1, [0], 0, 10)])
        await writer.close()
        return cache, checkpoint, ro(db).execute("SELECT count(*) FROM steps").fetchone()[0]

    # A negative cache_size is KiB; the rows still land. With the checkpointer thread the
    # writer's own automatic checkpoint is the backstop, at twice the cadence.
    assert asyncio.run(run()) == (-12_345, 8642 if checkpointer else 4321, 10)


def test_next_transaction_is_staged_and_handed_over_while_the_previous_one_is_written(tmp_path: Path) -> None:
    """With batches already queued, the writer hands transaction N to the database
    thread, stages N+1 and hands it over too, before N has finished: staging (event
    loop) and writing (sqlite's thread) overlap, and the database thread goes from
    one transaction straight to the next. Transactions finish in order."""
    db = tmp_path / "o.db"
    events: list[str] = []

    async def run() -> None:
        writer = StoreWriter(str(db), max_txn_bytes=1)  # one queued item per transaction
        await writer.open()
        stage, submit, finish = writer.stage, writer._submit, writer._finish

        def logged_stage(work: list[WorkItem], taken_bytes: int = 0) -> Any:
            events.extend(f"stage {item.seq}" for item in work)
            return stage(work, taken_bytes)

        async def logged_submit(staged: Any) -> Any:
            events.extend(f"submit {item.seq}" for item in staged.work)
            return await submit(staged)

        async def logged_finish(submitted: Any) -> bool:
            ok = await finish(submitted)
            events.extend(f"finish {item.seq}" for item in submitted.staged.work)
            return ok

        writer.stage = logged_stage  # type: ignore[method-assign]
        writer._submit = logged_submit  # type: ignore[method-assign]
        writer._finish = logged_finish  # type: ignore[method-assign]
        queue: ByteQueue[WorkItem] = ByteQueue(1 << 20)
        for seq in (1, 2, 3):
            await queue.put(batch(seq, [0], (seq - 1) * 10, 10), 100)
        await queue.close()
        await writer.run(queue)
        await writer.close()

    asyncio.run(run())
    assert events[:4] == ["stage 1", "submit 1", "stage 2", "submit 2"]
    assert [e for e in events if e.startswith("finish")] == ["finish 1", "finish 2", "finish 3"]
    assert events.index("stage 3") < events.index("finish 2")
    assert ro(db).execute("SELECT count(*) FROM steps").fetchone()[0] == 30


def test_an_idle_writer_waits_for_more_before_a_small_transaction(tmp_path: Path) -> None:
    """Relays flush at their own times. An idle writer that finds little queued waits
    ``coalesce_s`` for more, so one transaction (one COMMIT) carries what arrives
    meanwhile; without the wait, the first batch gets a transaction of its own."""

    async def transactions(coalesce_s: float) -> list[list[int]]:
        writer = StoreWriter(str(tmp_path / f"c{coalesce_s}.db"), coalesce_s=coalesce_s)
        await writer.open()
        queue: ByteQueue[WorkItem] = ByteQueue(1 << 20)
        staged: list[list[int]] = []
        stage, get_many = writer.stage, queue.get_many

        def logged_stage(work: list[WorkItem], taken_bytes: int = 0) -> Any:
            staged.append([item.seq for item in work])
            if 3 in staged[-1]:
                asyncio.get_running_loop().create_task(queue.close())  # everything is in: end the run
            return stage(work, taken_bytes)

        async def get_many_then_more(max_bytes: int, timeout: float) -> list[tuple[WorkItem, int]]:
            taken = await get_many(max_bytes, timeout)
            if [item.seq for item, _ in taken] == [1]:  # the first flush is taken: two more arrive
                for seq in (2, 3):
                    await queue.put(batch(seq, [seq], 0, 10), 100)
            return taken

        writer.stage = logged_stage  # type: ignore[method-assign]
        queue.get_many = get_many_then_more  # type: ignore[method-assign]
        await queue.put(batch(1, [1], 0, 10), 100)
        await writer.run(queue)
        await writer.close()
        return [seqs for seqs in staged if seqs]

    assert asyncio.run(transactions(0.2)) == [[1, 2, 3]]
    assert asyncio.run(transactions(0.0)) == [[1], [2, 3]]
    for name in ("c0.2.db", "c0.0.db"):
        assert ro(tmp_path / name).execute("SELECT count(*) FROM steps").fetchone()[0] == 30


def test_a_transaction_queued_behind_a_failed_one_is_not_committed_and_resending_loses_nothing(tmp_path: Path) -> None:
    """Transaction 2 fails inside SQLite, for a reason its data does not cause (as a
    full disk or an I/O error would), while 3 may already be queued behind it on the
    database thread (staged against 2's dedup marks). 3 is then skipped, not committed,
    and 4, from the same (now closed) connection, is dropped unstored: committing it
    would make the resent 2 and 3 duplicates of a later seq. Whatever was not
    acknowledged is resent, and every row ends up stored exactly once, with the stored
    counter equal to the rows."""
    import dataclasses

    db = tmp_path / "f.db"
    conn = failing_inserts(db, "steps", when="NEW.step = 15", kind="io")  # in transaction 2
    acked: dict[int, bool] = {}
    connection_failed = [False]  # as the server's AckWriter: closed at the first failure

    def done(seq: int, ok: bool) -> None:
        acked[seq] = ok
        connection_failed[0] = connection_failed[0] or not ok

    def item(seq: int) -> WorkItem:
        return dataclasses.replace(batch(seq, [0], (seq - 1) * 10, 10), done=lambda ok, seq=seq: done(seq, ok),
                                   live=lambda: not connection_failed[0])

    async def run() -> int:
        writer = StoreWriter(str(db), max_txn_bytes=1)  # one item per transaction
        await writer.open()
        queue: ByteQueue[WorkItem] = ByteQueue(1 << 20)
        for seq in (1, 2, 3, 4):
            await queue.put(item(seq), 100)
        await queue.close()
        await writer.run(queue)
        assert acked[1] and not acked[2]
        assert sorted(acked) == [1, 2, 3, 4]
        conn.execute("UPDATE meta SET value='0' WHERE key='fail'")
        connection_failed[0] = False  # a new connection
        for seq in sorted(s for s, ok in acked.items() if not ok):  # the relay resends
            assert await writer.write([item(seq)])
        await writer.close()
        return writer.counters.rows_stored

    rows_stored = asyncio.run(run())
    steps = [r[0] for r in conn.execute("SELECT step FROM steps ORDER BY step")]
    assert steps == list(range(40))
    assert rows_stored == 40
    stored = dict(conn.execute("SELECT counter, value FROM delivery WHERE source='daemon'").fetchall())
    assert stored["rows_stored"] == 40
