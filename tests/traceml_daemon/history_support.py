"""Shared builders for the store tests: history, retention, migrations, failed writes."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path
from typing import Any

from tests.traceml_daemon.wire_client import RELAY, agent_sender
from traceml_daemon.ingest.pipeline import WorkItem
from traceml_daemon.store.schema import HISTORY_METRICS
from traceml_wire.body import encode_body
from traceml_wire.tables import PHASES


def random_steps(rank: int, first: int, n: int, seed: int, ts0: float = 1_700_000_000.0) -> dict[str, list[Any]]:
    rng = random.Random(seed * 7919 + first)
    cols: dict[str, list[Any]] = {"step": list(range(first, first + n)), "ts": [ts0 + s for s in range(first, first + n)]}
    cols["step_ns"] = [rng.randint(10_000_000, 30_000_000) for _ in range(n)]
    for p in PHASES:
        # Some phases unmeasured now and then: NULL must stay out of the figures.
        cols[f"{p}_ns"] = [None if rng.random() < 0.1 else rng.randint(0, 5_000_000) for _ in range(n)]
    return cols


def batch(seq: int, ranks: list[int], first: int, n: int, ts0: float = 1_700_000_000.0,
          world_size: int | None = None) -> WorkItem:
    """One rbatch: ``n`` steps from ``first`` for each of ``ranks`` (node = rank // 2);
    ``world_size``: what the ranks state as their job's size (none stated by default)."""
    items = [[agent_sender("s1", r, node=r // 2), seq, encode_body({"steps": random_steps(r, first, n, r, ts0)})]
             for r in ranks]
    stated = {} if world_size is None else {"world_size": world_size}
    peers = {agent_sender("s1", r, node=r // 2): {"global_rank": r, "node_rank": r // 2, **stated} for r in ranks}
    return WorkItem(RELAY, "s1", seq, items, peers, {}, {})


def raw_buckets(conn: sqlite3.Connection, level: int) -> dict[tuple[int, int], tuple[Any, ...]]:
    """Ground truth from raw steps: (rank_id, bucket) -> n, then count/min/max/sum per metric."""
    aggs = ", ".join(f"count({m}_ns), min({m}_ns), max({m}_ns), coalesce(sum({m}_ns), 0)" for m in HISTORY_METRICS)
    rows = conn.execute(
        f"SELECT rank_id, step / {level}, count(*), {aggs} FROM steps GROUP BY rank_id, step / {level}"
    ).fetchall()
    return {(r[0], r[1]): tuple(r[2:]) for r in rows}


def stored_buckets(conn: sqlite3.Connection, level: int) -> dict[tuple[int, int], tuple[Any, ...]]:
    cols = ", ".join(f"{m}_n, {m}_min, {m}_max, {m}_sum" for m in HISTORY_METRICS)
    rows = conn.execute(f"SELECT rank_id, bucket, n, {cols} FROM rank_history WHERE level=?", (level,)).fetchall()
    return {(r[0], r[1]): tuple(r[2:]) for r in rows}


def ro(db: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{db}?mode=ro", uri=True)
