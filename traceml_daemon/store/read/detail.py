"""A rank's deep dive: the scalars it logged, its newest per-layer timings, its traced models."""

from __future__ import annotations

import sqlite3
from typing import Any

from traceml_daemon.store.schema import NONFINITE_SCALAR, rank_is


def scalar_names(conn: sqlite3.Connection, rank_id: int, limit: int = 32) -> list[str]:
    """The first ``limit`` names the rank logged, in name order."""
    # Skip-scan over the scalars index (group, name, step, rank): one seek per distinct name.
    names: list[str] = []
    last = ""
    while len(names) < limit:
        row = conn.execute(
            f"SELECT MIN(name) FROM scalars WHERE {rank_is('?1')} AND name>?2", (rank_id, last)
        ).fetchone()
        if row is None or row[0] is None:
            break
        last = row[0]
        names.append(last)
    return names


def latest_scalar(conn: sqlite3.Connection, rank_id: int, name: str) -> float | None:
    row = conn.execute(
        f"SELECT value FROM scalars WHERE {rank_is('?1')} AND name=?2 ORDER BY step DESC LIMIT 1", (rank_id, name)
    ).fetchone()
    return None if row is None else stored_real(row[0])


def stored_real(value: Any) -> float | None:
    """A REAL cell as stored: NaN is kept as the text 'NaN' (SQLite turns a NaN REAL into NULL)."""
    return float(value) if isinstance(value, str) else value


def first_nonfinite_scalars(conn: sqlite3.Connection, rank_ids: list[int]) -> list[tuple[int, str, int, float]]:
    """(rank_id, name, first step, value) of every scalar series of these ranks that
    became NaN or infinite, through the partial index of non-finite scalars."""
    out: list[tuple[int, str, int, float]] = []
    for rank_id in rank_ids:
        for name, step, value in conn.execute(
            f"SELECT name, MIN(step), value FROM scalars WHERE rank_id = ? AND ({NONFINITE_SCALAR}) GROUP BY name",
            (rank_id,),
        ):
            out.append((rank_id, name, step, float(value)))
    return out


def latest_layers(conn: sqlite3.Connection, rank_id: int) -> tuple[int | None, list[tuple[Any, ...]]]:
    """(step, rows) of the newest step with layer timings, each row (layer, forward_ns,
    backward_ns, activation_bytes) in the order they were stored; (None, []) without any."""
    step = conn.execute(f"SELECT MAX(step) FROM layers WHERE {rank_is('?1')}", (rank_id,)).fetchone()[0]
    if step is None:
        return None, []
    rows = conn.execute(
        f"SELECT layer, forward_ns, backward_ns, activation_bytes FROM layers WHERE {rank_is('?1')} AND step=?2 "
        "ORDER BY rowid",
        (rank_id, step),
    ).fetchall()
    return step, rows


def model_reports(conn: sqlite3.Connection, rank_id: int) -> list[tuple[Any, ...]]:
    """(model_id, name, parallelism, n_modules, param_bytes, local_shard_bytes,
    estimated_full_bytes) of every model report of the rank, oldest first."""
    return conn.execute(
        "SELECT model_id, name, parallelism, n_modules, param_bytes, local_shard_bytes, estimated_full_bytes "
        "FROM models WHERE rank_id=? ORDER BY rowid",
        (rank_id,),
    ).fetchall()


def fsdp2_memory(conn: sqlite3.Connection, rank_id: int) -> dict[str, int] | None:
    row = conn.execute(
        "SELECT local_shard_bytes, estimated_full_bytes FROM models WHERE rank_id=? AND parallelism='fsdp2' "
        "AND local_shard_bytes IS NOT NULL ORDER BY rowid DESC LIMIT 1",
        (rank_id,),
    ).fetchone()
    if row is None:
        return None
    return {"local_shard_bytes": row[0], "estimated_full_bytes": row[1]}
