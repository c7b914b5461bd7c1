"""The final summary of a run: a JSON-able dict, a text rendering, and the
final_summary.json / final_summary.txt files written next to the database."""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

from traceml_daemon.analysis.engine import diagnose
from traceml_daemon.analysis.model import PHASES, RankData, RunData, Verdict
from traceml_daemon.analysis.nodes import node_views, skews
from traceml_daemon.analysis.policy import Policy
from traceml_daemon.analysis.policy_file import policy_overrides
from traceml_daemon.analysis.report import format_verdicts
from traceml_daemon.analysis.stats import rank_ranges
from traceml_daemon.commands import json_out, summary_fsdp2
from traceml_daemon.commands.summary_rollouts import add_to as add_rollouts
from traceml_daemon.commands.summary_rollouts import render as rollout_lines
from traceml_daemon.store import reader
from traceml_daemon.store.gc_pause import gc_paused
from traceml_daemon.store.read import output
from traceml_wire.printable import printable_text

log = logging.getLogger("traceml_daemon.commands.summary")


def _median_ms(values: Sequence[int | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present) / 1e6, 3) if present else None


def _max(values: Sequence[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _verdicts(run: RunData, policy: Policy | None = None) -> list[dict[str, Any]]:
    try:
        return [v.to_json() for v in diagnose(run, policy)]
    except Exception:
        # A diagnosis bug must not cost the user their summary.
        log.exception("diagnosis failed; summary has no verdicts")
        return []


def _is_live(run: RunData) -> bool:
    """A run is live while some rank has not reported that it finished: then the
    liveness checks (RANK_STALLED, HANG) apply, against the current wall clock."""
    return any(r.status is not None and not r.status.finished for r in run.ranks)


def _rank_entry(conn: Any, row: reader.RankRow, data: RankData) -> dict[str, Any]:
    memory: dict[str, Any] = {"peak_bytes": _max(data.peak_bytes), "rss_bytes": _max(data.rss_bytes)}
    fsdp2 = summary_fsdp2.memory_entry(conn, row.rank_id, data)
    if fsdp2 is not None:
        memory["fsdp2"] = fsdp2
    return {
        "global_rank": row.global_rank,
        "local_rank": row.local_rank,
        "node_rank": row.node_rank,
        "hostname": row.hostname,
        # A long run's sample holds its first and last step (reader._sampled_steps), so
        # only the count differs from what was loaded: the stored one, counted in SQL.
        "steps": data.steps_stored if data.steps_stored is not None else len(data.steps),
        "first_step": data.steps[0] if data.steps else None,
        "last_step": data.steps[-1] if data.steps else None,
        # Steps the medians and verdicts read: all of them, or a long run's sample.
        "steps_analysed": len(data.steps),
        "step_ms_median": _median_ms(data.step_ns),
        "phases_ms_median": {p: _median_ms(data.phases_ns.get(p, [])) for p in PHASES},
        "memory": memory,
        # FSDP2: per step, time waiting in its collectives (forward, backward, shard, replicate)
        "collective_wait_ms_median": summary_fsdp2.wait_entry(data),
    }


def build_summary(db_path: str, policy: Policy | None = None, *, session: str | None = None) -> dict[str, Any]:
    """Summarise ``session`` (default: the latest run) at its highest attempt under ``policy``'s
    thresholds (None: the defaults). Raises reader.StoreError, reader.UnknownSession."""
    with gc_paused():  # a bulk read of acyclic rows (see gc_pause)
        return _build_summary(db_path, policy, session)


def _build_summary(db_path: str, policy: Policy | None = None, session: str | None = None) -> dict[str, Any]:
    conn = reader.open_readonly(db_path)
    try:
        run_ref = reader.resolve_run(conn, session)  # raises reader.UnknownSession
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
            # Thresholds a policy file changed (--policy): the verdicts were made with them.
            "policy_overrides": policy_overrides(policy) if policy is not None else {},
        }
        if run_ref is None:
            return summary
        rows = reader.load_ranks(conn, run_ref)
        run = reader.load_run(conn, run_ref, budget_rows=reader.SAMPLE_BUDGET_ROWS)
        if _is_live(run):
            run.live, run.now = True, time.time()
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
            nodes=node_views(run),
            skew=skews(run),
            verdicts=_verdicts(run, policy),
            live=run.live,
            # The rank whose traceback came first, from the ranks' captured output.
            failure=output.first_failure(conn, [(r.rank_id, d.global_rank) for r, d in zip(rows, run.ranks, strict=True)]),
        )
        add_rollouts(summary, conn, [(r.rank_id, r.global_rank) for r in rows], policy)
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


def _ranks_title(ranks: list[dict[str, Any]]) -> str:
    sampled = [r for r in ranks if r["steps_analysed"] != r["steps"]]
    if not sampled:
        return "Ranks (medians over all steps, ms)"
    least = min(r["steps_analysed"] for r in sampled)
    return (
        f"Ranks (medians, ms; a long run: {len(sampled)} rank(s) read as a uniform sample of "
        f">= {least:,} steps, the newest {reader.SAMPLE_TAIL_STEPS:,} all included)"
    )


def render_text(summary: dict[str, Any]) -> str:
    """Primary verdict first (why, what to try next, evidence), then the tables."""
    topo = summary["topology"]
    verdicts = [Verdict(**{k: v[k] for k in ("name", "severity", "scope", "why", "evidence", "next_step")})
                for v in summary["verdicts"]]
    lines = [
        f"TraceML summary  session {summary['session']}  attempt {summary.get('attempt')}"
        + ("  (run in progress)" if summary.get("live") else ""),
        f"topology: {topo['nnodes']} node(s) x world size {topo['world_size']}, {topo['parallelism']}",
        "",
        format_verdicts(verdicts),
        "",
        _ranks_title(summary["ranks"]),
    ]
    if summary.get("policy_overrides"):
        changed = [f"{s}.{k}={v}" for s, keys in summary["policy_overrides"].items() for k, v in keys.items()]
        lines[3:3] = ["thresholds changed by --policy: " + ", ".join(changed), ""]
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
    lines += summary_fsdp2.render(summary["ranks"])
    lines += ["", "Nodes (worst rank = most busy time: step minus all-reduce wait)"]
    lines += _table(
        ["node", "host", "ranks", "step ms", "busy ms", "worst rank", "worst busy ms"],
        [
            [
                _fmt(n["node_rank"]),
                _fmt(n["hostname"]),
                ",".join(str(r) for r in n["ranks"]),
                _fmt(n["step_ms_median"]),
                _fmt(n["busy_ms_median"]),
                _fmt(n["worst_rank"]["global_rank"]),
                _fmt(n["worst_rank"]["busy_ms_median"]),
            ]
            for n in summary["nodes"]
        ],
    )
    skew = summary.get("skew") or {}
    if skew.get("global_skew_ms") is not None:
        lines.append(
            f"skew: ranks {_fmt(skew['global_skew_ms'])} ms ({_fmt(skew['global_skew_pct'])}%), "
            f"busy {_fmt(skew.get('busy_skew_ms'))} ms, nodes {_fmt(skew.get('node_skew_ms'))} ms"
        )
    lines += _failure_lines(summary.get("failure"))
    lines += rollout_lines(summary)
    lines += ["", "Delivery"]
    lines += [f"  {k}: {v}" for k, v in summary["delivery"].items()]
    # Hostnames, sessions and verdict texts carry peer strings: no escape sequence reaches the terminal.
    return printable_text("\n".join(lines)) + "\n"


def _failure_lines(failure: dict[str, Any] | None) -> list[str]:
    """The first rank that failed: its exception, traceback and last lines (`logs` shows all)."""
    if not failure:
        return []
    others = [r for r in failure["ranks_with_traceback"] if r != failure["global_rank"]]
    lines = ["", f"First failure: rank {failure['global_rank']}: {failure['exception']}"]
    if others:
        lines.append(f"  (tracebacks also on ranks {rank_ranges(others)})")
    lines += [f"  {line}" for line in failure["traceback"]]
    lines.append(f"  last lines of rank {failure['global_rank']} (`traceml-daemon logs --rank "
                 f"{failure['global_rank']}` shows more):")
    lines += [f"    {line}" for line in failure["last_lines"]]
    return lines


def write_summary_files(db_path: str, summary: dict[str, Any]) -> list[str]:
    """Write final_summary.json and final_summary.txt beside the database; return the paths."""
    folder = os.path.dirname(os.path.abspath(db_path))
    paths = []
    for name, text in (
        ("final_summary.json", json_out.dumps(summary, indent=2, sort_keys=False) + "\n"),
        ("final_summary.txt", render_text(summary)),
    ):
        path = os.path.join(folder, name)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)  # readers never see half a file
        paths.append(path)
    return paths
