"""The raw tables keyed by step (scalars, layers, fingerprints) follow their rank's steps
under retention: by age, under the size cap, behind rows that stay, and in the real daemon."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from tests.support.procs import DaemonProcess, wait_for
from tests.traceml_daemon.history_support import random_steps, ro
from tests.traceml_daemon.wire_client import RELAY, WireClient, agent_sender
from traceml_daemon.ingest.pipeline import StoreWriter, WorkItem
from traceml_daemon.store.retention import RetentionPolicy
from traceml_daemon.store.step_keyed import LOWEST_STEP_SQL, STEP_KEYED_TABLES
from traceml_wire import messages
from traceml_wire.body import encode_body

NAMES = ("loss", "lr", "grad_norm", "tokens")


def _step_keyed(steps: list[int], layers: int = 2) -> dict[str, dict[str, list[Any]]]:
    """Per step: a scalar of each of NAMES, ``layers`` layer rows and fingerprint rows."""
    scalars: dict[str, list[Any]] = {"step": [], "name": [], "value": []}
    per_layer: dict[str, list[Any]] = {"step": [], "layer": [], "forward_ns": [], "backward_ns": [],
                                       "activation_bytes": []}
    prints: dict[str, list[Any]] = {"step": [], "model_id": [], "idx": [], "layer": [], "param_norm": [],
                                    "grad_norm": [], "grad_nonfinite": [], "shard": [], "param_sum": []}
    for s in steps:
        for name in NAMES:
            scalars["step"].append(s)
            scalars["name"].append(name)
            scalars["value"].append(float(s))
        for i in range(layers):
            for col, value in (("step", s), ("layer", f"l{i}"), ("forward_ns", 1000), ("backward_ns", 2000),
                               ("activation_bytes", 4096)):
                per_layer[col].append(value)
            for col, value in (("step", s), ("model_id", 0), ("idx", i), ("layer", f"l{i}.weight"),
                               ("param_norm", 1.5), ("grad_norm", 0.5), ("grad_nonfinite", 0), ("shard", 0),
                               ("param_sum", 12345 + s)):
                prints[col].append(value)
    return {"scalars": scalars, "layers": per_layer, "fingerprints": prints}


def _item(seq: int, rank: int, first: int, n: int, ts0: float, with_steps: bool = True) -> WorkItem:
    sender = agent_sender("s1", rank)
    steps = list(range(first, first + n))
    tables: dict[str, Any] = _step_keyed(steps)
    if with_steps:
        tables["steps"] = random_steps(rank, first, n, rank, ts0=ts0 - first)
    return WorkItem(RELAY, "s1", seq, [[sender, seq, encode_body(tables)]], {sender: {"global_rank": rank}}, {}, {})


def _counts(db: Path, rank_id: int | None = None) -> dict[str, tuple[int, int | None]]:
    """Per table: rows and lowest step (of one rank, or all)."""
    where = "" if rank_id is None else f" WHERE rank_id = {rank_id}"
    conn = ro(db)
    try:
        return {t: conn.execute(f"SELECT count(*), min(step) FROM {t}{where}").fetchone()
                for t in ("steps", *STEP_KEYED_TABLES)}
    finally:
        conn.close()


def test_age_retention_takes_the_step_keyed_rows_of_the_steps_it_deletes(tmp_path: Path) -> None:
    db = tmp_path / "age.db"
    now = time.time()

    async def go() -> int:
        writer = StoreWriter(str(db), retention=RetentionPolicy(max_age_s=7 * 86400, chunk_rows=300, max_chunks=1000))
        await writer.open()
        # Rank 0: steps 0..999 ten days old, 1000..1199 recent; rank 1 logs scalars and never steps.
        assert await writer.write([_item(1, 0, 0, 1000, now - 10 * 86400)])
        assert await writer.write([_item(1, 1, 0, 50, now, with_steps=False)])
        assert await writer.write([_item(2, 0, 1000, 200, now - 3000)])
        deleted = await writer.enforce_retention()
        await writer.close()
        return deleted

    deleted = asyncio.run(go())
    rank0 = _counts(db, 1)
    assert rank0["steps"] == (200, 1000)
    assert rank0["scalars"] == (200 * len(NAMES), 1000)
    assert rank0["layers"] == (400, 1000) and rank0["fingerprints"] == (400, 1000)
    assert deleted == 1000 * (1 + len(NAMES) + 2 + 2)
    # A rank that never stored a step keeps what it logged.
    assert _counts(db, 2)["scalars"] == (50 * len(NAMES), 0)


def test_a_rank_that_never_steps_ages_out_by_the_daemons_clock(tmp_path: Path) -> None:
    """Rows of a rank that stored no step (scalars logged outside any step: step None, or
    steps of its own count) go once nothing of it arrived within the age limit, by the
    daemon's clock (ranks.last_seen); a rank seen recently keeps them."""
    db = tmp_path / "stepless.db"
    now = time.time()

    def logger(seq: int, rank: int) -> WorkItem:
        sender = agent_sender("s1", rank)
        body = encode_body({"scalars": {"step": [None, None, 3, 4], "name": ["reward"] * 4,
                                        "value": [0.5, 0.6, 0.7, 0.8]}})
        return WorkItem(RELAY, "s1", seq, [[sender, seq, body]], {sender: {"global_rank": rank}}, {}, {})

    async def go() -> None:
        writer = StoreWriter(str(db), retention=RetentionPolicy(max_age_s=7 * 86400, chunk_rows=100))
        await writer.open()
        assert await writer.write([logger(1, 7), logger(1, 8)])
        async with writer._db.execute(  # type: ignore[union-attr]
            "UPDATE ranks SET last_seen = ? WHERE global_rank = 7", (now - 8 * 86400,)
        ):
            pass
        await writer._db.commit()  # type: ignore[union-attr]
        await writer.enforce_retention()
        await writer.close()

    asyncio.run(go())
    conn = ro(db)
    try:
        left = conn.execute("SELECT r.global_rank, count(*) FROM scalars s JOIN ranks r USING (rank_id) "
                            "GROUP BY r.global_rank").fetchall()
    finally:
        conn.close()
    assert left == [(8, 4)]  # rank 7, silent for 8 days of a 7-day limit, lost all four rows


def test_a_ranks_lowest_step_is_one_index_search(tmp_path: Path) -> None:
    db = tmp_path / "plan.db"

    async def go() -> None:
        writer = StoreWriter(str(db))
        await writer.open()
        assert await writer.write([_item(1, r, 0, 50, time.time()) for r in range(20)])
        await writer.close()

    asyncio.run(go())
    conn = ro(db)
    try:
        plan = " | ".join(row[3] for row in conn.execute(f"EXPLAIN QUERY PLAN {LOWEST_STEP_SQL}", (7,)))
        assert conn.execute(LOWEST_STEP_SQL, (7,)).fetchone() == (0,)
    finally:
        conn.close()
    assert "SEARCH steps USING" in plan and "steps_by_group" in plan, plan
    assert "SCAN" not in plan and "TEMP B-TREE" not in plan, plan


def test_the_size_cap_holds_when_step_keyed_rows_are_most_of_the_database(tmp_path: Path) -> None:
    """Before, the cap deleted every step and stopped there, over the cap, with the rows logged
    against those steps all kept."""
    db = tmp_path / "size.db"
    cap = 1024 * 1024

    async def go() -> None:
        writer = StoreWriter(str(db))
        await writer.open()
        for i in range(10):  # 10,000 steps of 2 ranks, 14 step-keyed rows each
            assert await writer.write([_item(i + 1, r, i * 1000, 1000, time.time()) for r in (0, 1)])
        await writer.close()
        writer = StoreWriter(str(db), retention=RetentionPolicy(max_db_bytes=cap, chunk_rows=500,
                                                                max_chunks=10_000))
        await writer.open()
        assert await writer.enforce_retention() > 0
        await writer.close()

    asyncio.run(go())
    conn = ro(db)
    try:
        pages, free, size = (conn.execute(f"PRAGMA {p}").fetchone()[0]
                             for p in ("page_count", "freelist_count", "page_size"))
        assert (pages - free) * size <= cap
    finally:
        conn.close()
    for rank_id in (1, 2):
        counts = _counts(db, rank_id)
        kept, first = counts["steps"]
        assert 0 < kept < 10_000 and first is not None
        # What stays is the newest steps, and every step-keyed row of them, none older.
        assert counts["scalars"] == (kept * len(NAMES), first)
        assert counts["layers"] == (2 * kept, first) and counts["fingerprints"] == (2 * kept, first)


def test_the_sweep_reaches_stale_rows_behind_rows_that_stay(tmp_path: Path) -> None:
    """A rank that never steps logged first: its rows fill the front of every step-keyed table.
    While the trainer's steps age out pass after pass, the sweep goes on past those rows and
    takes the trainer's stale ones (one that began again at the front whenever steps went
    would never get past them), and it ends its lap once steps stop going."""
    db = tmp_path / "behind.db"
    now = time.time()
    policy = RetentionPolicy(max_age_s=7 * 86400, chunk_rows=100, max_chunks=4)
    rounds, per_round = 30, 10

    async def go() -> tuple[int, bool]:
        writer = StoreWriter(str(db), retention=policy)
        await writer.open()
        assert await writer.write([_item(1, 5, 0, 300, now, with_steps=False)])  # 1200 scalars in front
        for i in range(rounds):  # the trainer's steps: each batch ends with a recent one, a pass after each
            assert await writer.write([_item(2 * i + 1, 0, i * per_round, per_round, now - 10 * 86400),
                                       _item(2 * i + 2, 0, 10_000 + i, 1, now - 60)])
            await writer.enforce_retention()
        stale_left = _counts(db, 2)["scalars"][0] - rounds * len(NAMES)
        for _ in range(100):
            await writer.enforce_retention()
            if not writer.retention.sweep.due:
                break
        await writer.close()
        return stale_left, writer.retention.sweep.due

    stale_left, due = asyncio.run(go())
    assert stale_left <= rounds * per_round * len(NAMES) // 2  # swept while steps went
    assert not due  # the lap ended
    trainer = _counts(db, 2)
    assert trainer["steps"] == (rounds, 10_000)
    assert trainer["scalars"] == (rounds * len(NAMES), 10_000)
    assert trainer["layers"] == (2 * rounds, 10_000) and trainer["fingerprints"] == (2 * rounds, 10_000)
    assert _counts(db, 1)["scalars"] == (300 * len(NAMES), 0)


def test_the_daemon_trims_a_runs_scalars_with_its_steps(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    steps, kept = 200, 9
    with DaemonProcess(db, args=["--retention-days", "0.0001"]) as daemon:  # 8.64 s of the run's clock
        with WireClient(daemon.port) as c:
            assert c.handshake("relay/s1/n0/9-r")["t"] == messages.ACCEPT
            sender = agent_sender("s1", 0)
            tables: dict[str, Any] = _step_keyed(list(range(steps)))
            tables["steps"] = random_steps(0, 0, steps, 0)
            c.rbatch(1, [[sender, 1, encode_body(tables)]], {sender: {"global_rank": 0, "world_size": 1}})
            assert c.recv() == {"t": "ack", "seq": 1}

        def trimmed() -> dict[str, tuple[int, int | None]] | None:
            counts = _counts(db)
            return counts if counts["scalars"][0] == kept * len(NAMES) else None

        counts = wait_for(trimmed, timeout=60, what="retention to trim the scalars")
        assert daemon.stop() == 0, daemon.log()
    assert counts["steps"] == (kept, steps - kept)
    assert counts["scalars"] == (kept * len(NAMES), steps - kept)
    assert counts["layers"] == (2 * kept, steps - kept) and counts["fingerprints"] == (2 * kept, steps - kept)
