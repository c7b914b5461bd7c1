"""The summary's view of tracing beyond the step: profiler trace files and whether rollout sessions exist.

``entries`` adds ``profiles`` (every torch.profiler trace file a rank wrote: rank,
step, steps, path) and ``rollout_sessions`` (rows stored; ``traceml-daemon
sessions`` has the records and their figures) to the summary; ``render`` the
text lines.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from traceml_daemon.store.read.rollouts import has_sessions, run_profiles, session_rows


def entries(conn: sqlite3.Connection, ranks: list[tuple[int, int | None]]) -> dict[str, Any]:
    return {
        "profiles": [p.__dict__ for p in run_profiles(conn, ranks)],
        "rollout_sessions": session_rows(conn, ranks) if has_sessions(conn) else 0,
    }


def render(summary: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    if summary.get("rollout_sessions"):
        lines += ["", f"Rollout sessions stored: `traceml-daemon sessions --db {summary['db']}` for the records, "
                      "phase percentiles and rollout verdicts"]
    profiles = summary.get("profiles") or []
    if profiles:
        lines += ["", "torch.profiler traces"]
        lines += [f"  rank {p['rank']} step {p['step']} ({p['steps']} steps): {p['path']}" for p in profiles]
    return lines
