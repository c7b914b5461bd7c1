"""FSDP2 step columns and mesh, read where the database has them (schema v10 on).

The collective wait per step (``fwd_comm_ns``, ``bwd_comm_ns``, ``replicate_comm_ns``)
and ``post_forward_bytes`` were appended to ``steps`` by a later schema step, so the
common step reads (``steps.STEP_COLS``) leave them out and a database not migrated
yet still reads; here they are read for an FSDP2 run only, one index range per rank,
and lined up with the steps already loaded.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from traceml_daemon.analysis.model import RankData
from traceml_daemon.store.read.steps import rows_at_steps
from traceml_daemon.store.schema import rank_is

STEP_FIELDS = ("fwd_comm_ns", "bwd_comm_ns", "replicate_comm_ns", "post_forward_bytes")
MODEL_FIELDS = ("local_shard_bytes", "estimated_full_bytes", "shard_degree", "replicate_degree")


def _columns(conn: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}


def has_step_fields(conn: sqlite3.Connection) -> bool:
    return set(STEP_FIELDS) <= _columns(conn, "steps")


def fill_steps(conn: sqlite3.Connection, ranks: list[tuple[int, RankData]]) -> None:
    """Set each RankData's FSDP2 lists, parallel to its ``steps`` (None where a step has no value).

    ``ranks``: (rank_id, data) with ``data.steps`` loaded, oldest first. With two traced
    models in one process the first model's row of a step stands for it, as elsewhere."""
    if not ranks or not has_step_fields(conn):
        return
    select = ", ".join(STEP_FIELDS)
    for rank_id, data in ranks:
        if not data.steps:
            continue
        by_step = _by_step(conn, rank_id, select, data.steps)
        empty = (None,) * len(STEP_FIELDS)
        aligned = [by_step.get(step, empty) for step in data.steps]
        data.fwd_comm_ns, data.bwd_comm_ns, data.replicate_comm_ns, data.post_forward_bytes = (
            [row[i] for row in aligned] for i in range(len(STEP_FIELDS))
        )


def collective_wait(
    conn: sqlite3.Connection, ranks: list[tuple[int, list[int]]]
) -> dict[int, dict[int, tuple[Any, ...]]]:
    """Per rank_id, (fwd_comm_ns, bwd_comm_ns) of its ``steps`` (sorted), by step, for the
    ranks that measured any (FSDP2 ranks); empty when the database has no such columns."""
    if not ranks or not has_step_fields(conn):
        return {}
    out: dict[int, dict[int, tuple[Any, ...]]] = {}
    for rank_id, steps in ranks:
        if not steps:
            continue
        by_step = _by_step(conn, rank_id, "fwd_comm_ns, bwd_comm_ns", steps)
        if any(f is not None or b is not None for f, b in by_step.values()):
            out[rank_id] = by_step
    return out


def _by_step(conn: sqlite3.Connection, rank_id: int, select: str, steps: list[int]) -> dict[int, tuple[Any, ...]]:
    """``select``'s values of the rank's ``steps``, by step; with two traced models in one
    process the first model's row of a step stands for it."""
    by_step: dict[int, tuple[Any, ...]] = {}
    for step, *values in _rows(conn, rank_id, select, steps):
        by_step.setdefault(step, tuple(values))
    return by_step


def _rows(conn: sqlite3.Connection, rank_id: int, select: str, steps: list[int]) -> list[tuple[Any, ...]]:
    """The rank's rows of these steps (oldest first): one index range where the steps are
    (nearly) all of their span, index seeks by chunks where they are a sample of a long run."""
    first, last = steps[0], steps[-1]
    if last - first + 1 <= 2 * len(steps):
        return conn.execute(
            f"SELECT step, {select} FROM steps WHERE {rank_is('?1')} AND step BETWEEN ?2 AND ?3 "
            "ORDER BY step, model_id",
            (rank_id, first, last),
        ).fetchall()
    return rows_at_steps(conn, rank_id, f"step, {select}", steps, "step, model_id")


def model_facts(conn: sqlite3.Connection, rank_id: int) -> dict[str, int | None] | None:
    """The rank's newest FSDP2 model row: shard and full bytes, mesh degrees (None: not stated)."""
    have = _columns(conn, "models")
    select = ", ".join(f if f in have else "NULL" for f in MODEL_FIELDS)
    row = conn.execute(
        f"SELECT {select} FROM models WHERE rank_id=? AND parallelism='fsdp2' ORDER BY rowid DESC LIMIT 1",
        (rank_id,),
    ).fetchone()
    return None if row is None else dict(zip(MODEL_FIELDS, row, strict=True))


def recent_view(conn: sqlite3.Connection, rank_id: int, last_n: int = 64) -> dict[str, Any] | None:
    """The rank's FSDP2 shard view: model facts plus medians over its newest ``last_n`` steps
    (collective wait per phase and on the replicate dim, device peak, memory after forward).
    None when the rank traced no FSDP2 model; a median is None where nothing was measured."""
    facts = model_facts(conn, rank_id)
    if facts is None:
        return None
    fields = ("peak_bytes", *STEP_FIELDS) if has_step_fields(conn) else ("peak_bytes",)
    rows = conn.execute(
        f"SELECT {', '.join(fields)} FROM steps WHERE {rank_is('?1')} ORDER BY step DESC LIMIT ?2",
        (rank_id, last_n),
    ).fetchall()
    view: dict[str, Any] = dict(facts)
    for i, name in enumerate(fields):
        present = sorted(r[i] for r in rows if r[i] is not None)
        view[name] = present[len(present) // 2] if present else None
    for name in STEP_FIELDS:
        view.setdefault(name, None)
    return view
