"""What the Rollouts screen reads (stdlib sqlite3, no Textual): the run's rollout sessions
summarised as ``traceml-daemon sessions`` does (sessions per second, statuses, phase
percentiles, oldest pending, reasons, the trainer's wait, rollout verdicts), over each
rank's newest ``NEWEST_SESSIONS`` sessions so a refresh stays bounded in a long run.
Every statement is the read layer's; each call opens its own read-only connection."""

from __future__ import annotations

import time
from typing import Any

from traceml_daemon.commands.sessions import Run, load_summary
from traceml_daemon.store.read.connect import connect
from traceml_daemon.store.read.runs import RunRef

NEWEST_SESSIONS = 5000  # session rows per rank a refresh reads


def read_rollouts(db_path: str, run: RunRef, now: float | None = None) -> dict[str, Any]:
    conn = connect(db_path)
    try:
        return load_summary(Run(conn, run, newest=NEWEST_SESSIONS), time.time() if now is None else now)
    finally:
        conn.close()
