"""The final summary of a run: a JSON-able dict, a text rendering, and the
final_summary.json / final_summary.txt files written next to the database."""

from __future__ import annotations

import json
import logging
import os
import statistics
from collections.abc import Sequence
from typing import Any

from traceml_daemon.analysis.model import PHASES, RankData, RunData
from traceml_daemon.store import reader

log = logging.getLogger("traceml_daemon.summary")


def _median_ms(values: Sequence[int | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present) / 1e6, 3) if present else None


def _max(values: Sequence[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _verdicts(run: RunData) -> list[dict[str, Any]]:
    try:
        from traceml_daemon.analysis.engine import diagnose
    except ImportError:
        return []
    try:
        return [v.to_json() for v in diagnose(run)]
    except Exception:
        # A diagnosis bug must not cost the user their summary.
        log.exception("diagnosis failed; summary has no verdicts")
        return []


def _rank_entry(conn: Any, row: reader.RankRow, data: RankData) -> dict[str, Any]:
    memory: dict[str, Any] = {"peak_bytes": _max(data.peak_bytes), "rss_bytes": _max(data.rss_bytes)}
    fsdp2 = reader.fsdp2_memory(conn, row.rank_id)
    if fsdp2 is not None:
        memory["fsdp2"] = fsdp2
    return {
        "global_rank": row.global_rank,
        "local_rank": row.local_rank,
        "node_rank": row.node_rank,
        "hostname": row.hostname,
        "steps": len(data.steps),
        "first_step": data.steps[0] if data.steps else None,
        "last_step": data.steps[-1] if data.steps else None,
        "step_ms_median": _median_ms(data.step_ns),
        "phases_ms_median": {p: _median_ms(data.phases_ns.get(p, [])) for p in PHASES},
        "memory": memory,
    }


def _nodes(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_node: dict[int | None, list[dict[str, Any]]] = {}
    for rank in ranks:
        by_node.setdefault(rank["node_rank"], []).append(rank)
    out = []
    for node_rank in sorted(by_node, key=lambda n: (n is None, n or 0)):
        members = by_node[node_rank]
        timed = [r for r in members if r["step_ms_median"] is not None]
        worst = max(timed, key=lambda r: r["step_ms_median"]) if timed else None
        hostnames = sorted({r["hostname"] for r in members if r["hostname"]})
        out.append(
            {
                "node_rank": node_rank,
                "hostname": hostnames[0] if len(hostnames) == 1 else ",".join(hostnames) or None,
                "ranks": [r["global_rank"] for r in members],
                "step_ms_median": round(statistics.median(r["step_ms_median"] for r in timed), 3) if timed else None,
                "worst_rank": worst["global_rank"] if worst else None,
                "worst_rank_step_ms": worst["step_ms_median"] if worst else None,
            }
        )
    return out


def build_summary(db_path: str) -> dict[str, Any]:
    """Summarise the latest run (latest session, highest attempt). Raises reader.StoreError."""
    conn = reader.open_readonly(db_path)
    try:
        run_ref = reader.latest_run(conn)
        summary: dict[str, Any] = {
            "schema_version": reader.schema_version(conn),
            "db": os.path.abspath(db_path),
            "session": run_ref.session if run_ref else None,
            "attempt": run_ref.attempt if run_ref else None,
            "attempts": sorted({r.attempt for r in reader.list_runs(conn) if run_ref and r.session == run_ref.session}),
            "started_at": None,
            "ended_at": None,
            "topology": {"nnodes": 0, "world_size": 0, "parallelism": "single"},
            "ranks": [],
            "nodes": [],
            "verdicts": [],
            "delivery": reader.delivery_counters(conn),
        }
        if run_ref is None:
            return summary
        rows = reader.load_ranks(conn, run_ref)
        run = reader.load_run(conn, run_ref)
        ranks = [_rank_entry(conn, row, data) for row, data in zip(rows, run.ranks, strict=True)]
        started, ended = reader.run_bounds(conn, run_ref)
        node_ranks = {r.node_rank for r in rows if r.node_rank is not None}
        stated_world = max((r.world_size for r in rows if r.world_size is not None), default=None)
        summary.update(
            started_at=started,
            ended_at=ended,
            topology={
                "nnodes": max(len(node_ranks), max((r.nnodes or 0 for r in rows), default=0)),
                "world_size": stated_world if stated_world is not None else len(rows),
                "parallelism": run.parallelism,
            },
            ranks=ranks,
            nodes=_nodes(ranks),
            verdicts=_verdicts(run),
        )
        return summary
    finally:
        conn.close()


# ------------------------------------------------------------------ text


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}M"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "-" * len(line)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return out


def render_text(summary: dict[str, Any]) -> str:
    topo = summary["topology"]
    lines = [
        f"TraceML summary  session {summary['session']}  attempt {summary.get('attempt')}",
        f"topology: {topo['nnodes']} node(s) x world size {topo['world_size']}, {topo['parallelism']}",
        "",
        "Ranks (medians over all steps, ms)",
    ]
    headers = ["rank", "node", "local", "host", "steps", "step", *PHASES, "peak", "rss"]
    rows = [
        [
            _fmt(r["global_rank"]),
            _fmt(r["node_rank"]),
            _fmt(r["local_rank"]),
            _fmt(r["hostname"]),
            _fmt(r["steps"]),
            _fmt(r["step_ms_median"]),
            *(_fmt(r["phases_ms_median"][p]) for p in PHASES),
            _mib(r["memory"]["peak_bytes"]),
            _mib(r["memory"]["rss_bytes"]),
        ]
        for r in summary["ranks"]
    ]
    lines += _table(headers, rows)
    lines += ["", "Nodes"]
    lines += _table(
        ["node", "host", "ranks", "step ms", "worst rank", "worst ms"],
        [
            [
                _fmt(n["node_rank"]),
                _fmt(n["hostname"]),
                ",".join(str(r) for r in n["ranks"]),
                _fmt(n["step_ms_median"]),
                _fmt(n["worst_rank"]),
                _fmt(n["worst_rank_step_ms"]),
            ]
            for n in summary["nodes"]
        ],
    )
    lines += ["", "Verdicts"]
    if not summary["verdicts"]:
        lines.append("  none")
    for v in summary["verdicts"]:
        scope = ", ".join(f"{k}={val}" for k, val in v.get("scope", {}).items()) or "run"
        lines.append(f"  [{v['severity']}] {v['name']} ({scope}): {v['why']}")
        if v.get("next_step"):
            lines.append(f"      next: {v['next_step']}")
    lines += ["", "Delivery"]
    lines += [f"  {k}: {v}" for k, v in summary["delivery"].items()]
    return "\n".join(lines) + "\n"


def write_summary_files(db_path: str, summary: dict[str, Any]) -> list[str]:
    """Write final_summary.json and final_summary.txt beside the database; return the paths."""
    folder = os.path.dirname(os.path.abspath(db_path))
    paths = []
    for name, text in (
        ("final_summary.json", json.dumps(summary, indent=2, sort_keys=False) + "\n"),
        ("final_summary.txt", render_text(summary)),
    ):
        path = os.path.join(folder, name)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)  # readers never see half a file
        paths.append(path)
    return paths
