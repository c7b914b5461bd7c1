"""The TraceML terminal UI: ``traceml-daemon tui --db PATH``.

Reads happen in a thread worker (sqlite never blocks the UI loop); only one
read runs at a time because the reader keeps incremental state on a single
connection. Every ``poll_s`` the app asks the reader whether anything was
committed since the last look (``PRAGMA data_version``: microseconds, no
query), and reads only then, so a step is on screen about ``poll_s`` after the
daemon commits it while an idle run costs nothing; it reads at least every
``refresh_s`` anyway (uptime, liveness). Reads are spaced so that refreshing
takes at most about a quarter of the wall time (1024 ranks: a few per second).
Diagnosis and node views (the costly part at thousands of ranks) run in a
second worker on their own connection, on the first refresh and then about
every ``analyze_every`` x ``refresh_s`` seconds, so a refresh never waits for
them; their result is merged into the snapshot already shown. The view shows
one run (``tui.follow``): ``--session``'s, else the latest as of opening; a job
that starts later is announced, and ``r`` opens the run picker. Pass ``clock``
to freeze "now" (snapshots); ``refresh_s=0`` reads only on mount and on
navigation (tests).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from textual import work
from textual.app import App
from textual.binding import Binding

from traceml_daemon.analysis.policy import Policy
from traceml_daemon.store.read.runs import RunInfo, RunRef
from traceml_daemon.tui.analyzer import Analyzer
from traceml_daemon.tui.data import TuiData, read_runs, session_error
from traceml_daemon.tui.model import Analysis, DatabaseMissing, Snapshot, with_analysis
from traceml_daemon.tui.screens import (
    HelpScreen,
    JumpScreen,
    LogsScreen,
    NodeScreen,
    OverviewScreen,
    Pick,
    RankScreen,
    RunsScreen,
    StepScreen,
    VerdictsScreen,
)
from traceml_daemon.tui.screens.rollouts import RolloutsScreen
from traceml_daemon.tui.widgets import clean

DEFAULT_DB = "traceml.db"

CSS = """
.section { color: $accent; text-style: bold; margin-top: 1; }
#header { height: auto; background: $boost; padding: 0 1; }
#banner { height: auto; padding: 0 1; }
#nodes { height: auto; max-height: 12; }
#ranks { height: auto; max-height: 24; }
#gpus { height: auto; max-height: 10; }
#layers { height: auto; max-height: 20; }
VerticalScroll { padding: 0 1; }
"""


class TraceApp(App[None]):
    """Overview -> node -> rank drill-down over one database, read-only."""

    TITLE = "TraceML"
    CSS = CSS
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("v", "verdicts", "Findings"),
        Binding("slash", "jump", "Jump"),
        Binding("r", "runs", "Runs"),
        Binding("question_mark", "help", "Help"),
        Binding("o", "rollouts", "Rollouts", show=False),
        Binding("i", "inspect", "Inspect step", show=False),
        Binding("l", "logs", "Logs", show=False),
    ]

    def __init__(
        self,
        db_path: str,
        *,
        clock: Callable[[], float] | None = None,
        refresh_s: float = 1.0,
        poll_s: float = 0.1,
        analyze_every: int = 5,
        policy: Policy | None = None,
        session: str | None = None,
    ) -> None:
        super().__init__()
        self.db_path = db_path
        self.clock = clock or time.time
        self.refresh_s = refresh_s
        self.poll_s = min(poll_s, refresh_s) if refresh_s > 0 else 0.0
        # session: pinned (tui --session); None follows the latest run and announces new ones.
        self.data = TuiData(db_path, clock=self.clock, session=session)  # raises DatabaseMissing with the path
        self.announced: set[str] = set()  # new runs already notified, each once
        self.analyzer = Analyzer(db_path, clock=self.clock, policy=policy)  # policy: tui --policy
        self.analyze_every = max(1, analyze_every)
        self.analysis: Analysis | None = None  # latest result of the analysis worker
        self.analysis_count = 0  # completed analyses (tests and bench wait on this)
        self._analyzing = False
        self._analysis_due = False  # scheduled to start after the next paint
        self._analysis_not_before = 0.0  # monotonic; keeps the analyzer's share of the CPU bounded
        self.refresh_count = 0  # completed refreshes (tests and bench wait on this)
        self.last_snapshot: Snapshot | None = None
        self.last_error: str | None = None
        self._busy = False
        self._pending = False
        self._dirty = False  # a commit seen by the poll, not read yet
        self._read_started = -1e9  # monotonic start of the last read
        self._last_cost_s = 0.0  # last read start to its paint (worker, UI update, render)
        self._analysis_next = 0.0  # monotonic; time-based cadence when refreshing on a timer
        # Cost of the last refresh, for the benchmark: read (worker) and widget update (UI thread).
        self.last_read_s = 0.0
        self.last_apply_s = 0.0

    # ---- lifecycle and refresh

    def on_mount(self) -> None:
        self.push_screen(OverviewScreen())
        self.request_refresh()
        if self.refresh_s > 0:
            self.set_interval(self.poll_s, self._poll)

    def on_unmount(self) -> None:
        self.data.close()
        self.analyzer.close()

    def _target(self) -> tuple[str, int | None]:
        screen = self.screen
        if isinstance(screen, NodeScreen):
            return ("node", screen.node_rank)
        if isinstance(screen, RankScreen):
            return ("rank", screen.global_rank)
        return ("overview", None)

    def _poll(self) -> None:
        """Timer tick: read when something was committed, or when ``refresh_s`` passed."""
        if not self._dirty and self.data.changed():
            self._dirty = True  # remembered: a tick that must wait below still reads it later
        if self._busy:
            return
        since = time.monotonic() - self._read_started
        # Spacing reads by 4x their cost keeps refreshing under ~25% of a core at any
        # size; at a few ranks a read costs milliseconds, so this is the poll itself.
        if (self._dirty and since >= 4.0 * self._last_cost_s) or since >= self.refresh_s:
            self.request_refresh()

    def request_refresh(self) -> None:
        """Start a read unless one is running; then run once more right after it."""
        if self._busy:
            self._pending = True
            return
        self._busy = True
        self._pending = False
        self._dirty = False
        self._read_started = time.monotonic()
        self._read(self._target())

    @work(thread=True, group="refresh", exit_on_error=False)
    def _read(self, target: tuple[str, int | None]) -> None:
        t0 = time.perf_counter()
        try:
            overview = self.data.overview(self.analysis)
            kind, key = target
            node = self.data.node_detail(key) if kind == "node" and key is not None else None
            rank = self.data.rank_detail(key) if kind == "rank" and key is not None else None
            snap: Snapshot | None = Snapshot(overview, node, rank)
            error = None
        except Exception as exc:  # a locked or half-written db: show it, keep the UI alive
            snap, error = None, f"{exc.__class__.__name__}: {exc}"
        self.last_read_s = time.perf_counter() - t0
        self.call_from_thread(self._apply, snap, target, error)

    def _apply(self, snap: Snapshot | None, target: tuple[str, int | None], error: str | None) -> None:
        t0 = time.perf_counter()
        self._busy = False
        if snap is not None:
            self.last_snapshot = snap
            screen = self.screen
            if target == self._target() and hasattr(screen, "show"):
                screen.show(snap)
            elif isinstance(screen, VerdictsScreen):
                screen.show(snap)
            else:
                self._pending = True  # the screen changed while reading: read for the new one
        if snap is not None:
            self._announce(snap.overview.new_runs)
        if error != self.last_error and error is not None:
            # markup=False: the message may quote a name a peer sent.
            self.notify(error, title="read failed", severity="error", markup=False)
        self.last_error = error
        self.last_apply_s = time.perf_counter() - t0
        self.call_after_refresh(self._painted, self._read_started)
        if snap is not None and self._analysis_wanted():
            # After the paint, so the first screen does not wait on ~1 s of analysis at 4096
            # ranks; flagged before the count moves, so whoever waits on the count sees it.
            self._analysis_due = True
            self.call_after_refresh(self.request_analysis)
        self.refresh_count += 1
        if self._pending:
            self.request_refresh()

    def _painted(self, started: float) -> None:
        if started == self._read_started:  # not a later read's paint
            self._last_cost_s = time.monotonic() - started

    # ---- analysis, off the refresh path

    def _analysis_wanted(self) -> bool:
        now = time.monotonic()
        if now < self._analysis_not_before:
            return False
        if self.refresh_s <= 0:  # no timer: every analyze_every-th refresh (tests)
            return self.refresh_count % self.analyze_every == 0
        # Refreshes follow commits, so their count no longer measures time.
        return now >= self._analysis_next

    def request_analysis(self) -> None:
        """Run the analyzer unless it is running (a slow one is skipped, not queued)."""
        self._analysis_due = False
        if self._analyzing:
            return
        self._analyzing = True
        self._analysis_next = time.monotonic() + self.analyze_every * self.refresh_s
        self._analyze()

    @work(thread=True, group="analysis", exit_on_error=False)
    def _analyze(self) -> None:
        t0 = time.monotonic()
        try:
            shown = self.data.run  # the run on screen; another may be picked meanwhile
            result: Analysis | None = self.analyzer.run(shown)
        except Exception as exc:  # a locked db: the next round retries; the refresh shows the error
            result = None
            self.log.warning(f"analysis failed: {exc.__class__.__name__}: {exc}")
        self.call_from_thread(self._apply_analysis, result, time.monotonic() - t0, shown)

    def _apply_analysis(self, result: Analysis | None, took_s: float, shown: RunRef | None = None) -> None:
        self._analyzing = False
        if shown != self.data.run:
            result = None  # findings of a run no longer on screen
        # Python threads share one core's worth of GIL: an analysis taking 1 s (4096
        # ranks) every 5 s would slow every refresh; keep it to about a fifth of the time.
        self._analysis_not_before = time.monotonic() + 4.0 * took_s
        self.analysis_count += 1
        if result is None:
            return
        self.analysis = result
        snap = self.last_snapshot
        if snap is None:
            return
        snap = Snapshot(with_analysis(snap.overview, result), snap.node, snap.rank)
        self.last_snapshot = snap
        screen = self.screen
        if isinstance(screen, OverviewScreen | VerdictsScreen):
            screen.show(snap)

    # ---- navigation

    def open_node(self, node_rank: int) -> None:
        self.push_screen(NodeScreen(node_rank))
        self.request_refresh()

    def open_rank(self, global_rank: int) -> None:
        self.push_screen(RankScreen(global_rank))
        self.request_refresh()

    def action_verdicts(self) -> None:
        if not isinstance(self.screen, VerdictsScreen):
            self.push_screen(VerdictsScreen())
            if self.last_snapshot is not None:
                self.call_after_refresh(self._show_current)

    def _show_current(self) -> None:
        if self.last_snapshot is not None and hasattr(self.screen, "show"):
            self.screen.show(self.last_snapshot)

    # ---- runs: the picker, and runs that start while the view follows another

    def _announce(self, new_runs: list[str]) -> None:
        for session in new_runs:
            if session not in self.announced:
                self.announced.add(session)
                # markup=False: a session id is text a peer sent.
                self.notify(f"new run {clean(session)} started (r: pick a run to show)", title="new run",
                            markup=False)

    def action_runs(self) -> None:
        if not isinstance(self.screen, RunsScreen):
            self._read_runs()

    @work(thread=True, group="runs", exclusive=True, exit_on_error=False)
    def _read_runs(self) -> None:
        try:
            runs, latest = read_runs(self.db_path)
        except Exception as exc:  # a locked db: say so, keep the UI alive
            self.call_from_thread(self.notify, f"{exc.__class__.__name__}: {exc}", title="runs", severity="error",
                                  markup=False)
            return
        self.call_from_thread(self._open_runs, runs, latest)

    def _open_runs(self, runs: list[RunInfo], latest: RunRef | None) -> None:
        if not isinstance(self.screen, RunsScreen):
            pinned = self.data.choice.pinned is not None
            self.push_screen(RunsScreen(runs, latest, self.data.run, pinned, self.clock()), self.show_run)

    def show_run(self, pick: Pick | None) -> None:
        """Show the run picked (``Pick(None)``: follow the latest run again); None: keep the view."""
        if pick is None:
            return
        self.data.select(pick.session)
        self.analysis = None  # the findings were of the run shown before
        while len(self.screen_stack) > 1 and not isinstance(self.screen, OverviewScreen):
            super().pop_screen()
        self.notify("following the latest run" if pick.session is None else f"showing run {clean(pick.session)}",
                    title="runs", markup=False)
        self._analysis_next = 0.0  # findings for the new run at the next refresh
        self.request_refresh()

    # ---- evidence: one step across the ranks, the ranks' output

    def action_inspect(self) -> None:
        """The step inspector: a rank's newest step from its screen, the step where the first
        rank verdict shows most from the findings, else the newest step every rank recorded."""
        screen, run = self.screen, self.data.run
        if run is None or not isinstance(screen, OverviewScreen | NodeScreen | RankScreen | VerdictsScreen):
            return
        rank = screen.global_rank if isinstance(screen, RankScreen) else None
        verdict_rank = None
        if isinstance(screen, VerdictsScreen) and self.last_snapshot is not None:
            ranked = [v.scope["global_rank"] for v in self.last_snapshot.overview.verdicts if "global_rank" in v.scope]
            verdict_rank = ranked[0] if ranked else None
        self.push_screen(StepScreen(self.db_path, run, rank=rank, verdict_rank=verdict_rank))

    def action_logs(self) -> None:
        run = self.data.run
        if run is not None and not isinstance(self.screen, LogsScreen | StepScreen):
            self.push_screen(LogsScreen(self.db_path, run, reload_s=2.0 * self.refresh_s))

    def action_rollouts(self) -> None:
        """An RL job's rollout sessions (traceml_daemon/tui/screens/rollouts.py)."""
        run = self.data.run
        if run is not None and not isinstance(self.screen, RolloutsScreen):
            self.push_screen(RolloutsScreen(self.db_path, run, reload_s=2.0 * self.refresh_s))

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_jump(self) -> None:
        if not isinstance(self.screen, JumpScreen):
            self.push_screen(JumpScreen(), self._jump_to)

    def _jump_to(self, query: str | None) -> None:
        if not query:
            return
        found = parse_jump(query, self.last_snapshot)
        if found is None:
            self.notify(f"no rank or node {query.strip()!r} in this run", severity="warning", markup=False)
        elif found[0] == "rank":
            self.open_rank(found[1])
        else:
            self.open_node(found[1])

    def pop_screen(self) -> Any:
        result = super().pop_screen()
        self.request_refresh()  # the screen underneath may be stale
        return result


def parse_jump(query: str, snap: Snapshot | None) -> tuple[str, int] | None:
    """ "r12"/"12" -> ("rank", 12); "n3" -> ("node", 3); None when not in the run."""
    q = query.strip().lower()
    kind = "rank"
    if q[:1] in ("r", "n"):
        kind = "node" if q[0] == "n" else "rank"
        q = q[1:].strip()
    if not q.isdigit() or snap is None:
        return None
    n = int(q)
    ranks = snap.overview.ranks
    if kind == "rank" and any(r.global_rank == n for r in ranks):
        return ("rank", n)
    if kind == "node" and any(r.node_rank == n for r in ranks):
        return ("node", n)
    return None


def run_tui(db_path: str, policy: Policy | None = None, session: str | None = None) -> None:
    """Open the TUI on ``db_path`` (live or finished run) diagnosing under ``policy``; blocks until quit.

    ``session``: show that run; None follows the latest one."""
    TraceApp(db_path, policy=policy, session=session).run()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", default=DEFAULT_DB, help="SQLite database written by traceml-daemon serve")
    parser.add_argument("--policy", metavar="FILE", help="TOML file overriding diagnosis thresholds (docs/diagnosis.md)")
    parser.add_argument("--session", default=None,
                        help="show this session (default: the latest run, without jumping to runs that start later)")


def _parse(args: Sequence[str] | argparse.Namespace | None) -> argparse.Namespace:
    if isinstance(args, argparse.Namespace):
        return args
    parser = argparse.ArgumentParser(prog="traceml-daemon tui", description="Attach to a live or finished run.")
    add_arguments(parser)
    return parser.parse_args(list(args) if args is not None else None)


def main(args: Sequence[str] | argparse.Namespace | None = None) -> int:
    """CLI entry: ``traceml-daemon tui [--db PATH] [--policy FILE] [--session ID]``; returns the exit status."""
    from traceml_daemon.analysis.policy_file import PolicyFileError, load_policy

    ns = _parse(args)
    db = str(getattr(ns, "db", None) or DEFAULT_DB)
    if not os.path.exists(db):
        print(f"traceml-daemon tui: no database at {db!r}; pass --db PATH of a run", file=sys.stderr)
        return 2
    path = getattr(ns, "policy", None)
    try:
        policy = load_policy(path) if path else None
    except PolicyFileError as exc:
        print(f"traceml-daemon tui: {exc}", file=sys.stderr)
        return 2
    session = getattr(ns, "session", None)
    problem = session_error(db, session) if session is not None else None
    if problem is not None:
        print(f"traceml-daemon tui: {db}: {problem}", file=sys.stderr)
        return 2
    try:
        run_tui(db, policy, session)
    except DatabaseMissing as exc:
        print(f"traceml-daemon tui: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
