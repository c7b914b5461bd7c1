"""History from agents' partials (traceml_wire/partials.py): the writer merges what a
batch's agent summed instead of folding its rows, stores the same history as from
the rows, and folds the rows itself whenever partials are refused."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

from tests.traceml_daemon.history_support import batch, raw_buckets, ro, stored_buckets
from traceml_daemon.ingest.pipeline import StoreWriter, WorkItem
from traceml_daemon.store.schema import HISTORY_LEVELS

Edit = Callable[[dict[str, Any]], None]


def _edited(work: WorkItem, edit: Edit) -> WorkItem:
    """``work`` with every body unpacked, changed by ``edit`` and packed again."""
    items = []
    for sender, seq, body in work.items:
        raw = msgpack.unpackb(body, raw=False)
        edit(raw)
        items.append([sender, seq, msgpack.packb(raw, use_bin_type=True)])
    return WorkItem(work.relay_sender, work.session, work.seq, items, work.peers, work.node, work.stats)


def _strip(raw: dict[str, Any]) -> None:
    raw.pop("history", None)


def _write(db: Path, batches: list[WorkItem]) -> dict[str, int]:
    async def go() -> dict[str, int]:
        writer = StoreWriter(str(db))
        await writer.open()
        for b in batches:
            assert await writer.write([b])
        await writer.close()
        return writer.counters.as_dict()

    return asyncio.run(go())


def _batches() -> list[WorkItem]:
    # Sizes with and without partials (PARTIALS_MIN_STEPS = 64), buckets split across
    # batches, so one fold merges partials with stats of rows folded here.
    out, step = [], 0
    for seq, n in enumerate((100, 5, 64, 3, 1000, 63, 2100), start=1):
        out.append(batch(seq, [0, 1, 2, 3], step, n))
        step += n
    return out


def _history(conn: sqlite3.Connection) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    ranks = conn.execute("SELECT * FROM rank_history ORDER BY rank_id, level, bucket").fetchall()
    nodes = conn.execute("SELECT * FROM node_history ORDER BY session, attempt, node_rank, level, bucket").fetchall()
    return ranks, nodes


def test_history_from_partials_equals_history_from_rows(tmp_path: Path) -> None:
    batches = _batches()
    sent = [b.items[0][2] for b in batches]
    assert [b"history" in body for body in sent] == [True, False, True, False, True, False, True]
    with_partials, rows_only = tmp_path / "p.db", tmp_path / "r.db"
    _write(with_partials, batches)
    _write(rows_only, [_edited(b, _strip) for b in batches])
    p, r = ro(with_partials), ro(rows_only)
    assert _history(p) == _history(r)
    for level in HISTORY_LEVELS:
        assert stored_buckets(p, level) == raw_buckets(p, level), level


def test_the_writer_merges_partials_as_sent_without_refolding_the_rows(tmp_path: Path) -> None:
    # A partial that still passes every check but says the first bucket's slowest step
    # took 1 ns longer: history shows the partial's figure, so the rows were not folded.
    def slower(raw: dict[str, Any]) -> None:
        raw["history"]["cols"]["step_max"][0] += 1
        raw["history"]["cols"]["step_sum"][0] += 1

    db = tmp_path / "h.db"
    _write(db, [_edited(batch(1, [0], 0, 200), slower)])
    conn = ro(db)
    raw, stored = raw_buckets(conn, 64), stored_buckets(conn, 64)
    key = min(raw)
    step_max = 3  # n, then step_n, step_min, step_max
    assert stored[key][step_max] == raw[key][step_max] + 1
    assert {k: v for k, v in stored.items() if k != key} == {k: v for k, v in raw.items() if k != key}


def test_refused_partials_are_counted_and_their_rows_folded_instead(tmp_path: Path) -> None:
    def miscounted(raw: dict[str, Any]) -> None:
        raw["history"]["cols"]["n"][0] -= 1  # one step fewer than the batch holds

    def garbage(raw: dict[str, Any]) -> None:
        raw["history"] = "not partials"

    db = tmp_path / "h.db"
    counters = _write(db, [_edited(batch(1, [0, 1], 0, 300), miscounted), _edited(batch(2, [0, 1], 300, 300), garbage)])
    assert counters["partials_refused"] == 4  # two ranks, two batches each
    assert counters["bad_bodies"] == 0
    conn = ro(db)
    assert conn.execute("SELECT count(*) FROM steps").fetchone()[0] == 1200  # nothing lost
    for level in HISTORY_LEVELS:
        assert stored_buckets(conn, level) == raw_buckets(conn, level), level
    stored = dict(conn.execute("SELECT counter, value FROM delivery WHERE source='daemon'").fetchall())
    assert stored["partials_refused"] == 4
