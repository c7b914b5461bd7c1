"""The summary's view of tracing beyond the step: rollout verdicts, profiler trace files.

``add_to`` adds to a summary ``profiles`` (every torch.profiler trace file a rank
wrote: rank, step, steps, path), ``rollout_sessions`` (rows stored; ``traceml-daemon
sessions`` has the records and their figures) and, when the run has rollout
sessions, the rollout verdicts (over each rank's newest ``NEWEST_SESSIONS``
sessions, so a long run's summary stays bounded) to its ``verdicts``; ``render``
the text lines.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from typing import Any

from traceml_daemon.analysis import rollout_stats
from traceml_daemon.analysis.policy import Policy
from traceml_daemon.analysis.rollouts import TrainerWait, rollout_verdicts
from traceml_daemon.store.read.rollouts import has_sessions, run_profiles, run_sessions, session_rows, trainer_wait

NEWEST_SESSIONS = 20_000  # session rows per rank the summary's rollout verdicts read
log = logging.getLogger("traceml_daemon.commands.summary")


def add_to(summary: dict[str, Any], conn: sqlite3.Connection, ranks: list[tuple[int, int | None]],
           policy: Policy | None = None) -> None:
    summary["profiles"] = [p.__dict__ for p in run_profiles(conn, ranks)]
    rows = session_rows(conn, ranks) if has_sessions(conn) else 0
    summary["rollout_sessions"] = rows
    if not rows:
        return
    try:
        stats = rollout_stats.collect(run_sessions(conn, ranks, NEWEST_SESSIONS))
        steps, step_s, waiting_s = trainer_wait(conn, ranks)
        found = rollout_verdicts(stats, time.time(), policy or Policy(), TrainerWait(step_s, waiting_s, steps))
        summary["verdicts"] = list(summary.get("verdicts") or []) + [v.to_json() for v in found]
    except Exception:
        # A diagnosis bug must not cost the user their summary.
        log.exception("rollout diagnosis failed; the summary has no rollout verdicts")


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
