"""FSDP2 in the final summary: per rank, the shard and mesh, memory per step, and the
time spent waiting in FSDP2's collectives (JSON entries and the text table)."""

from __future__ import annotations

import sqlite3
import statistics
from collections.abc import Sequence
from typing import Any

from traceml_daemon.analysis.model import RankData
from traceml_daemon.store.read import fsdp2


def _median(values: Sequence[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return int(statistics.median(present)) if present else None


def _median_ms(values: Sequence[int | None]) -> float | None:
    med = _median(values)
    return None if med is None else round(med / 1e6, 3)


def memory_entry(conn: sqlite3.Connection, rank_id: int, data: RankData) -> dict[str, Any] | None:
    """``memory.fsdp2`` of a rank: shard and estimated full bytes, mesh degrees, and per step
    the device peak and the memory held after forward (None where not measured: CPU)."""
    facts = fsdp2.model_facts(conn, rank_id)
    if facts is None:
        return None
    return {
        **facts,
        "peak_bytes_median": _median(data.peak_bytes),
        "post_forward_bytes_median": _median(data.post_forward_bytes),
    }


def wait_entry(data: RankData) -> dict[str, float | None] | None:
    """Median per step of the time waiting in FSDP2 collectives: by phase, and by mesh dimension."""
    if all(v is None for v in data.fwd_comm_ns) and all(v is None for v in data.bwd_comm_ns):
        return None
    shard = [
        None if f is None and b is None else (f or 0) + (b or 0) - (r or 0)
        for f, b, r in zip(data.fwd_comm_ns, data.bwd_comm_ns, _padded(data.replicate_comm_ns, data), strict=True)
    ]
    return {
        "forward": _median_ms(data.fwd_comm_ns),
        "backward": _median_ms(data.bwd_comm_ns),
        "shard": _median_ms(shard),
        "replicate": _median_ms(data.replicate_comm_ns),
    }


def _padded(values: list[int | None], data: RankData) -> list[int | None]:
    return values if len(values) == len(data.fwd_comm_ns) else [None] * len(data.fwd_comm_ns)


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f}M"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _mesh(m: dict[str, Any]) -> str:
    shard, replicate = m.get("shard_degree"), m.get("replicate_degree")
    if shard is None:
        return "-"
    return f"{replicate}x{shard}" if replicate else str(shard)


def render(ranks: list[dict[str, Any]]) -> list[str]:
    """The text section (empty when no rank traced an FSDP2 model)."""
    rows = [r for r in ranks if (r.get("memory") or {}).get("fsdp2") is not None]
    if not rows:
        return []
    headers = ["rank", "mesh", "shard", "full (est.)", "peak/step", "after fwd", "rss", "fwd wait", "bwd wait",
               "replicate"]
    table = []
    for r in rows:
        m = r["memory"]["fsdp2"]
        w = r.get("collective_wait_ms_median") or {}
        table.append([str(r["global_rank"]), _mesh(m), _mib(m.get("local_shard_bytes")),
                      _mib(m.get("estimated_full_bytes")), _mib(m.get("peak_bytes_median")),
                      _mib(m.get("post_forward_bytes_median")), _mib(r["memory"].get("rss_bytes")),
                      _ms(w.get("forward")), _ms(w.get("backward")), _ms(w.get("replicate"))])
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))
    out = ["", "FSDP2 (mesh replicate x shard; memory per step, medians; wait in FSDP2's collectives, ms per step)",
           line, "-" * len(line)]
    out += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in table]
    return out
