"""The writer sets aside what cannot be stored and goes on: a transaction that fails
for its data is written apart, what fails alone lands in ``quarantine`` with its
reason, everything else is stored, and every batch is acknowledged. A failure
that is not the data's still leaves its batches unacknowledged."""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tests.traceml_daemon.history_support import batch, ro
from tests.traceml_daemon.ingest.faults import failing_inserts
from tests.traceml_daemon.wire_client import RELAY, agent_sender, steps_body
from traceml_daemon.ingest import decode
from traceml_daemon.ingest.pipeline import StoreWriter, WorkItem
from traceml_daemon.net.inbound import ByteQueue
from traceml_daemon.store.migrate import migrate
from traceml_daemon.store.migrations import MIGRATIONS
from traceml_daemon.store.schema import HISTORY_LEVELS, NONFINITE_SCALAR, SCHEMA_VERSION
from traceml_wire.body import encode_body
from traceml_wire.bounds import INT64_MAX, MAX_DURATION_NS
from traceml_wire.tables import PHASES

A0, A1, A2 = (agent_sender("s1", r) for r in range(3))
PEERS = {a: {"global_rank": r, "node_rank": 0} for r, a in enumerate((A0, A1, A2))}


def work(seq: int, items: list[list[Any]], stats: dict[str, int] | None = None,
         acked: dict[int, bool] | None = None) -> WorkItem:
    def done(ok: bool) -> None:
        if acked is not None:
            acked[seq] = ok

    return WorkItem(RELAY, "s1", seq, items, PEERS, {"node_rank": 0}, stats or {}, done=done)


def daemon_counters(db: Path) -> dict[str, int]:
    conn = ro(db)
    try:
        return dict(conn.execute("SELECT counter, value FROM delivery WHERE source='daemon'").fetchall())
    finally:
        conn.close()


def quarantine_rows(db: Path) -> list[tuple[Any, ...]]:
    conn = ro(db)
    try:
        return conn.execute("SELECT relay, sender, seq, reason, body, body_bytes FROM quarantine ORDER BY id").fetchall()
    finally:
        conn.close()


def steps_by_rank(db: Path) -> dict[int, list[int]]:
    conn = ro(db)
    try:
        rows = conn.execute("SELECT r.global_rank, s.step FROM steps s JOIN ranks r USING (rank_id) ORDER BY 1, 2")
        out: dict[int, list[int]] = {}
        for rank, step in rows:
            out.setdefault(rank, []).append(step)
        return out
    finally:
        conn.close()


def test_a_transaction_failing_for_its_data_stores_the_rest_and_sets_the_culprit_aside(tmp_path: Path) -> None:
    """Three rbatches in one transaction; a constraint fails on one agent item of the
    second. Each rbatch is then written alone, the second's parts each alone: its relay
    counters and its other item are stored, the failing item set aside with the reason,
    and all three acknowledged."""
    db = tmp_path / "q.db"
    conn = failing_inserts(db, "steps", when="NEW.step = 25", kind="data")
    acked: dict[int, bool] = {}
    bad_body = steps_body(20, 10)

    async def go() -> None:
        writer = StoreWriter(str(db))
        await writer.open()
        ok = await writer.write([
            work(1, [[A0, 1, steps_body(0, 10)]], acked=acked),
            work(2, [[A1, 1, bad_body], [A2, 1, steps_body(40, 10)]], {"dropped_batches": 3}, acked=acked),
            work(3, [[A0, 2, steps_body(10, 10)]], acked=acked),
        ])
        assert ok
        await writer.close()

    asyncio.run(go())
    assert steps_by_rank(db) == {0: list(range(20)), 2: list(range(40, 50))}
    relay = dict(conn.execute("SELECT counter, value FROM delivery WHERE source=?", ("relay:" + RELAY,)).fetchall())
    assert relay == {"dropped_batches": 3}
    rows = quarantine_rows(db)
    assert rows == [(RELAY, A1, "1", "write failed alone: IntegrityError: injected", bad_body, len(bad_body))]
    counters = daemon_counters(db)
    assert counters["batches_quarantined"] == 1 and counters["rows_stored"] == 30
    # The culprit's sender has no mark: had it been stored, its resend would be a duplicate.
    assert conn.execute("SELECT count(*) FROM ranks WHERE sender=?", (A1,)).fetchone()[0] == 0


def test_transactions_queued_behind_a_data_failure_are_written_not_dropped(tmp_path: Path) -> None:
    """With one batch per transaction, 3 and 4 are staged (and 3 queued) behind 2,
    which fails for its data: 2 is set aside, 3 and 4 are written all the same, and
    every batch is acknowledged on the connection it came on."""
    db = tmp_path / "s.db"
    failing_inserts(db, "steps", when="NEW.step = 15", kind="data")  # in batch 2
    acked: dict[int, bool] = {}

    def item(seq: int) -> WorkItem:
        return dataclasses.replace(batch(seq, [0], (seq - 1) * 10, 10), done=lambda ok, seq=seq: acked.update({seq: ok}))

    async def go() -> StoreWriter:
        writer = StoreWriter(str(db), max_txn_bytes=1)
        await writer.open()
        queue: ByteQueue[WorkItem] = ByteQueue(1 << 20)
        for seq in (1, 2, 3, 4):
            await queue.put(item(seq), 100)
        await queue.close()
        await writer.run(queue)
        await writer.close()
        return writer

    writer = asyncio.run(go())
    assert acked == {1: True, 2: True, 3: True, 4: True}
    conn = ro(db)
    assert [r[0] for r in conn.execute("SELECT step FROM steps ORDER BY step")] == [*range(10), *range(20, 40)]
    assert [r[:3] for r in quarantine_rows(db)] == [(RELAY, agent_sender("s1", 0), "2")]
    assert writer.counters.rows_stored == daemon_counters(db)["rows_stored"] == 30
    assert daemon_counters(db)["batches_quarantined"] == 1


def test_a_failure_that_is_not_the_datas_is_not_acknowledged_nor_set_aside(tmp_path: Path) -> None:
    db = tmp_path / "io.db"
    conn = failing_inserts(db, "steps", when="NEW.step = 5", kind="io")

    async def go() -> None:
        writer = StoreWriter(str(db))
        await writer.open()
        assert not await writer.write([work(1, [[A0, 1, steps_body(0, 10)]])])
        conn.execute("UPDATE meta SET value='0' WHERE key='fail'")
        assert await writer.write([work(1, [[A0, 1, steps_body(0, 10)]])])  # the resend
        await writer.close()

    asyncio.run(go())
    assert quarantine_rows(db) == []
    assert steps_by_rank(db) == {0: list(range(10))}


def test_work_whose_staging_fails_is_written_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug the data triggers while staging (not a checked problem): the rest of the
    transaction is stored, the batch that triggers it alone is set aside."""
    db = tmp_path / "st.db"
    original = decode.Ingestor._add_tables

    def add_tables(self: decode.Ingestor, plan: decode.Plan, rank_id: int, sender: str, tables: Any) -> None:
        if sender == A1:
            raise KeyError("a bug")
        original(self, plan, rank_id, sender, tables)

    monkeypatch.setattr(decode.Ingestor, "_add_tables", add_tables)

    async def go() -> None:
        writer = StoreWriter(str(db))
        await writer.open()
        # True: every batch stored or set aside.
        assert await writer.write([work(1, [[A0, 1, steps_body(0, 5)], [A1, 1, steps_body(0, 5)]]),
                                   work(2, [[A2, 1, steps_body(0, 5)]])])
        await writer.close()

    asyncio.run(go())
    assert steps_by_rank(db) == {0: list(range(5)), 2: list(range(5))}
    assert [(r[1], r[3]) for r in quarantine_rows(db)] == [(A1, "write failed alone: KeyError: 'a bug'")]

    # The same through the writer's loop, behind and ahead of other transactions: every
    # batch acknowledged, A1's once set aside, the others stored.
    db = tmp_path / "st2.db"
    acked: dict[int, bool] = {}

    async def loop() -> None:
        writer = StoreWriter(str(db), max_txn_bytes=1)
        await writer.open()
        queue: ByteQueue[WorkItem] = ByteQueue(1 << 20)
        await queue.put(work(1, [[A0, 1, steps_body(0, 5)]], acked=acked), 100)
        await queue.put(work(2, [[A1, 1, steps_body(0, 5)], [A2, 1, steps_body(0, 5)]], acked=acked), 100)
        await queue.put(work(3, [[A0, 2, steps_body(5, 5)]], acked=acked), 100)
        await queue.close()
        await writer.run(queue)
        await writer.close()

    asyncio.run(loop())
    assert acked == {1: True, 2: True, 3: True}
    assert steps_by_rank(db) == {0: list(range(10)), 2: list(range(5))}
    assert [r[1] for r in quarantine_rows(db)] == [A1]


def test_items_failing_their_checks_are_set_aside_alone(tmp_path: Path) -> None:
    """Checked at decode: a bad body, a seq beyond int64, a sender beyond its bound,
    a seq far past its sender's mark. Each is set aside with its reason, the rest of
    the rbatch stored; the jumped sender's mark stays, so its next batch is stored."""
    db = tmp_path / "c.db"
    long_sender = "x" * 400

    async def go() -> None:
        writer = StoreWriter(str(db))
        await writer.open()
        assert await writer.write([work(1, [[A0, 1, steps_body(0, 2)]])])
        assert await writer.write([work(2, [
            [A0, 2**63 - 1, steps_body(2, 2)],  # forged: far past A0's mark 1
            [A1, 2**64 - 1, steps_body(0, 2)],
            [long_sender, 1, steps_body(0, 2)],
            [A2, 1, b"\xc1 not msgpack"],
            [A0, 2, steps_body(2, 2)],
        ])])
        assert await writer.write([work(3, [[A0, 3, steps_body(4, 2)]])])
        await writer.close()

    asyncio.run(go())
    rows = quarantine_rows(db)
    assert [(r[1], r[2], r[3]) for r in rows] == [
        (A0, str(2**63 - 1), f"seq {2**63 - 1} jumps more than {2**20} past the sender's last seq 1"),
        (A1, str(2**64 - 1), "seq outside 1..2**63-1"),
        ("x" * 300 + "... (400 characters)", "1", "sender of 400 characters (at most 256)"),
        (A2, "1", "bad body: batch body is not valid msgpack: FormatError"),
    ]
    assert steps_by_rank(db) == {0: list(range(6))}
    counters = daemon_counters(db)
    assert (counters["batches_quarantined"], counters["seq_jumps_refused"], counters["bad_bodies"]) == (4, 1, 1)
    conn = ro(db)
    assert conn.execute("SELECT last_seq FROM ranks WHERE sender=?", (A0,)).fetchone() == (3,)
    assert conn.execute("SELECT count(*) FROM ranks").fetchone() == (2,)  # A0, and A2 (its bad body advances it)


def test_relay_stats_are_bounded_in_name_value_and_number(tmp_path: Path) -> None:
    db = tmp_path / "r.db"
    stats: dict[str, Any] = {"dropped_batches": 2, "huge": 2**64 - 1, "negative": -1, "x" * 65: 1}
    stats |= {f"k{i}": i for i in range(100)}

    async def go() -> None:
        writer = StoreWriter(str(db))
        await writer.open()
        assert await writer.write([work(1, [[A0, 1, steps_body(0, 2)]], stats)])
        await writer.close()

    asyncio.run(go())
    conn = ro(db)
    stored = dict(conn.execute("SELECT counter, value FROM delivery WHERE source=?", ("relay:" + RELAY,)).fetchall())
    assert stored == {"dropped_batches": 2, **{f"k{i}": i for i in range(63)}}
    assert daemon_counters(db)["stats_refused"] == len(stats) - 64


def test_durations_beyond_the_bound_are_stored_as_not_measured(tmp_path: Path) -> None:
    db = tmp_path / "d.db"
    n = 64
    cols: dict[str, list[Any]] = {"step": list(range(n)), "ts": [1.0] * n, "step_ns": [10] * n}
    cols |= {f"{p}_ns": [None] * n for p in PHASES}
    cols["forward_ns"] = [2**62, -(2**62), MAX_DURATION_NS] + [5] * (n - 3)
    body = encode_body({"steps": cols})
    assert b"history" in body  # its agent summed the cells the daemon will not store

    async def go() -> None:
        writer = StoreWriter(str(db))
        await writer.open()
        assert await writer.write([work(1, [[A0, 1, body]])])
        await writer.close()

    asyncio.run(go())
    conn = ro(db)
    forward = [r[0] for r in conn.execute("SELECT forward_ns FROM steps ORDER BY step")]
    assert forward == [None, None, MAX_DURATION_NS] + [5] * (n - 3)
    counters = daemon_counters(db)
    # The partials counted the two cells now NULL: the rows are folded instead.
    assert (counters["durations_nulled"], counters["partials_refused"]) == (2, 1)
    got = conn.execute("SELECT forward_n, forward_max, forward_sum FROM rank_history WHERE level=64").fetchone()
    assert got == (n - 2, MAX_DURATION_NS, MAX_DURATION_NS + 5 * (n - 3))


def test_history_sums_saturate_in_python_and_in_sql(tmp_path: Path) -> None:
    """1024 steps of the longest duration stored fill a level-1024 bucket past int64,
    written over two transactions (the second merges in SQL): the sum is pinned at
    its bound, and the finer buckets stay exact."""
    db = tmp_path / "h.db"

    def body(first: int) -> bytes:
        return encode_body({"steps": {"step": list(range(first, first + 512)), "ts": [1.0] * 512,
                                      "step_ns": [MAX_DURATION_NS] * 512}})

    async def go() -> None:
        writer = StoreWriter(str(db), history_interval=0.0)
        await writer.open()
        assert await writer.write([work(1, [[A0, 1, body(0)]])])
        assert await writer.write([work(2, [[A0, 2, body(512)]])])
        await writer.close()

    asyncio.run(go())
    conn = ro(db)
    sums = dict(conn.execute("SELECT level, sum(step_n) FROM rank_history GROUP BY level").fetchall())
    assert sums == dict.fromkeys(HISTORY_LEVELS, 1024)
    coarse = conn.execute("SELECT level, step_sum, typeof(step_sum) FROM rank_history WHERE level > 64").fetchall()
    assert sorted(coarse) == [(1024, INT64_MAX, "integer"), (16384, INT64_MAX, "integer")]
    fine = {r[0] for r in conn.execute("SELECT step_sum FROM rank_history WHERE level = 64")}
    assert fine == {64 * MAX_DURATION_NS}


def test_a_nan_scalar_is_stored_and_found_through_the_nonfinite_index(tmp_path: Path) -> None:
    db = tmp_path / "n.db"
    values = [1.5, float("nan"), float("inf"), float("-inf"), None, 2]
    body = encode_body({"scalars": {"step": list(range(6)), "name": ["loss"] * 6, "value": values}})

    async def go() -> None:
        writer = StoreWriter(str(db))
        await writer.open()
        assert await writer.write([work(1, [[A0, 1, body]])])
        await writer.close()

    asyncio.run(go())
    conn = ro(db)
    stored = conn.execute("SELECT value, typeof(value) FROM scalars ORDER BY step").fetchall()
    assert stored == [(1.5, "real"), ("NaN", "text"), (float("inf"), "real"), (float("-inf"), "real"),
                      (None, "null"), (2.0, "real")]
    query = f"SELECT rank_id, name, step FROM scalars WHERE {NONFINITE_SCALAR} ORDER BY step"
    assert [r[2] for r in conn.execute(query)] == [1, 2, 3]
    plan = " ".join(r[3] for r in conn.execute("EXPLAIN QUERY PLAN " + query))
    assert "scalars_nonfinite" in plan
    one = f"SELECT min(step) FROM scalars WHERE rank_id = ?1 AND name = ?2 AND ({NONFINITE_SCALAR})"
    assert "USING INDEX scalars_nonfinite (rank_id=? AND name=?)" in " ".join(
        r[3] for r in conn.execute("EXPLAIN QUERY PLAN " + one, (1, "loss")))
    assert float(conn.execute(one, (1, "loss")).fetchone()[0]) == 1


def test_history_that_cannot_be_written_is_dropped_counted_and_not_retried(tmp_path: Path) -> None:
    """A history write that fails for what it holds, even alone, is let go (its rows
    stay raw) and counted; the writer goes on, and a reopened database does not fold
    those rows again."""
    db = tmp_path / "hd.db"
    conn = failing_inserts(db, "rank_history", when="NEW.bucket = 0", kind="data")

    async def go() -> StoreWriter:
        writer = StoreWriter(str(db), history_interval=0.0)
        await writer.open()
        assert await writer.write([batch(1, [0], 0, 10)])
        assert await writer.write([batch(2, [0], 10, 10)])  # carries the history, which fails
        assert await writer.write([batch(3, [0], 20, 10)])
        await writer.close()
        return writer

    writer = asyncio.run(go())
    assert writer.counters.history_writes_dropped >= 1
    assert [r[0] for r in conn.execute("SELECT step FROM steps ORDER BY step")] == list(range(30))
    assert daemon_counters(db)["history_writes_dropped"] == writer.counters.history_writes_dropped
    conn.execute("UPDATE meta SET value='0' WHERE key='fail'")

    async def reopen() -> None:
        writer = StoreWriter(str(db))
        await writer.open()
        await writer.close()

    asyncio.run(reopen())
    # Healed, a reopened writer would have written a catch-up fold: there was none.
    assert conn.execute("SELECT count(*) FROM rank_history").fetchone() == (0,)


def test_a_v6_database_opens_with_quarantine_and_the_nonfinite_index(tmp_path: Path) -> None:
    db = tmp_path / "v6.db"
    conn = sqlite3.connect(db, isolation_level=None)
    for statements in MIGRATIONS[:6]:
        for statement in statements:
            conn.execute(statement)
    conn.execute("INSERT INTO meta VALUES ('schema_version', '6')")
    conn.close()
    assert migrate(str(db)) == SCHEMA_VERSION
    conn = ro(db)
    names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
    assert {"quarantine", "scalars_nonfinite"} <= names
    conn.close()

    async def go() -> None:
        writer = StoreWriter(str(db))
        await writer.open()
        assert await writer.write([work(1, [[A0, 1, steps_body(0, 3)], [A1, 0, b""]])])
        await writer.close()

    asyncio.run(go())
    assert steps_by_rank(db) == {0: [0, 1, 2]}
