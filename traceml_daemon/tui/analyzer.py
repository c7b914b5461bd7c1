"""Diagnosis and node views over the recent windows, for the TUI's findings.

Costly at scale (hundreds of ms at thousands of ranks), so the app runs it in
its own worker at a lower rate than the refresh, on a connection of its own:
it never shares ``TuiData``'s, so the two workers may run at the same time.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from traceml_daemon.analysis.model import Verdict
from traceml_daemon.analysis.nodes import node_views
from traceml_daemon.analysis.policy import Policy
from traceml_daemon.store.read.connect import snapshot
from traceml_daemon.store.read.runs import RunRef
from traceml_daemon.store.reader import load_window_run
from traceml_daemon.tui.data import WINDOW, open_database
from traceml_daemon.tui.model import Analysis

_SEVERITY_ORDER = {"critical": 0, "warn": 1, "info": 2}


class Analyzer:
    """Findings and per-node worst ranks from each rank's newest ``window`` steps
    and each node's newest host and GPU samples (``store.reader.load_window_run``)."""

    def __init__(
        self, path: str, *, window: int = WINDOW, clock: Callable[[], float] | None = None, policy: Policy | None = None
    ) -> None:
        self.con = open_database(path)
        self.window = window
        self.clock = clock if clock is not None else time.time
        self.policy = policy  # tui --policy: the thresholds the findings are judged by (None: the defaults)

    def close(self) -> None:
        self.con.close()

    def run(self, shown: RunRef | None = None) -> Analysis:
        """Analyse ``shown``, the run the TUI shows (None: the latest run)."""
        with snapshot(self.con):
            run = load_window_run(self.con, self.window, self.clock(), shown)
        # analysis.nodes.node_views: the worst rank is the one with the most busy time,
        # the definition the summary uses too.
        views = {int(v["node_rank"]): v for v in node_views(run)}
        try:
            from traceml_daemon.analysis.engine import diagnose  # optional: the UI works without it
        except ImportError:
            return Analysis([], False, views, run.parallelism)
        try:
            verdicts = list(diagnose(run, self.policy))
        except Exception as exc:  # a diagnosis bug must not take the UI down
            verdicts = [Verdict("DIAGNOSIS_ERROR", "warn", {}, f"analysis failed: {exc.__class__.__name__}: {exc}")]
        verdicts.sort(key=lambda v: _SEVERITY_ORDER.get(v.severity, 3))
        return Analysis(verdicts, True, views, run.parallelism)
