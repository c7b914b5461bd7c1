"""Host, GPU and process samples of one rank (host and GPU samplers run on each
node's local rank 0; the process sampler on every rank).

Every read is the newest N rows through the table's per-rank index: bounded,
whatever the run's length. Rows come back as tuples in the order each function
names; oldest first unless it says newest first.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from traceml_daemon.store.schema import rank_is

HostRow = tuple[Any, ...]  # (ts, cpu_pct, mem_used_bytes, mem_total_bytes, net_rx_bps, net_tx_bps)
GpuRow = tuple[Any, ...]  # (gpu_index, util_pct, mem_used_bytes, mem_total_bytes, temp_c, power_w)


def host_samples(conn: sqlite3.Connection, rank_id: int, last_n: int) -> list[HostRow]:
    """The newest ``last_n`` host samples, oldest first."""
    rows = conn.execute(
        "SELECT ts, cpu_pct, mem_used_bytes, mem_total_bytes, net_rx_bps, net_tx_bps FROM system "
        f"WHERE {rank_is('?1')} ORDER BY ts DESC LIMIT ?2",
        (rank_id, last_n),
    ).fetchall()
    rows.reverse()
    return rows


def latest_host_sample(conn: sqlite3.Connection, rank_id: int) -> HostRow | None:
    """The newest host sample (one seek of the system index), or None."""
    rows = host_samples(conn, rank_id, 1)
    return rows[0] if rows else None


def latest_gpus(conn: sqlite3.Connection, rank_id: int, scan: int) -> list[GpuRow]:
    """Each GPU's newest sample among the rank's newest ``scan`` GPU rows, by GPU index."""
    latest: dict[int, GpuRow] = {}
    for row in conn.execute(
        "SELECT gpu_index, util_pct, mem_used_bytes, mem_total_bytes, temp_c, power_w FROM gpu "
        f"WHERE {rank_is('?1')} ORDER BY ts DESC LIMIT ?2",
        (rank_id, scan),
    ):
        if row[0] is not None and row[0] not in latest:  # newest first: the first row per GPU wins
            latest[row[0]] = row
    return [latest[k] for k in sorted(latest)]


def gpu_samples(conn: sqlite3.Connection, rank_id: int, last_n: int) -> list[tuple[Any, ...]]:
    """(gpu_index, util_pct, temp_c, mem_used_bytes, mem_total_bytes) of the newest
    ``last_n`` GPU rows (all GPUs together), oldest first."""
    rows = conn.execute(
        f"SELECT gpu_index, util_pct, temp_c, mem_used_bytes, mem_total_bytes FROM gpu WHERE {rank_is('?1')} "
        "ORDER BY ts DESC LIMIT ?2",
        (rank_id, last_n),
    ).fetchall()
    rows.reverse()
    return rows


def process_samples(conn: sqlite3.Connection, rank_id: int, last_n: int) -> list[tuple[Any, ...]]:
    """(ts, cpu_pct, rss_bytes, gpu_mem_bytes, threads) of the newest ``last_n`` process
    samples, oldest first."""
    rows = conn.execute(
        f"SELECT ts, cpu_pct, rss_bytes, gpu_mem_bytes, threads FROM process WHERE {rank_is('?1')} "
        "ORDER BY ts DESC LIMIT ?2",
        (rank_id, last_n),
    ).fetchall()
    rows.reverse()
    return rows
