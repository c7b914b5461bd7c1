"""The TUI's refresh reader: one database, read-only, cheap to refresh repeatedly
(stdlib sqlite3 only, no Textual; the app calls it from a thread worker).

Every statement is the read layer's (``store.read``, ``store.reader``); this
module keeps the state that makes refreshes incremental and builds the view
models of ``tui.model`` from it. Every read is bounded:

* each rank's newest ``window`` steps are loaded once, set-based (one statement
  for all ranks through the steps index), then extended by the rows appended
  since (``rowid > last``: rows are only ever appended), into the same rolling
  window the daemon keeps (``analysis.rolling.RankWindow``, via ``tui.ranks``);
* series are aggregated in SQL into cached power-of-two buckets
  (``store.read.series``), so a refresh only aggregates the new steps and never
  returns more than W points; host, GPU and process series read the last W samples;
* with the v2 history tables the run's span comes from the history, and so does
  its sparkline (a cross-rank series over the whole run, O(width) rows) once the
  history has ``MIN_HISTORY_POINTS`` points or retention has deleted the run's
  first raw steps; a younger run draws its lowest rank's raw steps, which are
  then fewer than 64 x ``MIN_HISTORY_POINTS``;
* delivery counters are the summary's (``store.read.delivery``).

Diagnosis and node views run in ``tui.analyzer.Analyzer``, on a connection of its
own, so the app can run them in their own worker at a lower rate.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from traceml_daemon.store import reader
from traceml_daemon.store.read import delivery, history, steps
from traceml_daemon.store.read.connect import connect, data_version, has_table, snapshot
from traceml_daemon.store.read.runs import (
    LIVE_SILENCE_S,
    RunInfo,
    RunRef,
    UnknownSession,
    latest_run,
    resolve_run,
    run_infos,
    run_last_seen,
    run_parallelism,
)
from traceml_daemon.store.read.series import Series
from traceml_daemon.tui import details
from traceml_daemon.tui.follow import RunChoice
from traceml_daemon.tui.model import (
    Analysis,
    DatabaseMissing,
    Delivery,
    JobHeader,
    NodeDetail,
    Overview,
    RankDetail,
    downsample,
    nodes_from,
    with_analysis,
)
from traceml_daemon.tui.ranks import LiveRank

WINDOW = 32  # recent steps per rank kept in memory for medians and diagnosis
SERIES_POINTS = 120  # default W for downsampled series
# The history's finest level holds 64 steps a point, so a young run has a handful of
# points there: below this many the lowest rank's raw steps (fewer than 64 x this many
# rows, so the read stays bounded) draw a finer line, unless retention already deleted
# the run's first raw steps and only the history still covers them.
MIN_HISTORY_POINTS = 32
# ``delivery_counters`` sums every relay counter under ``relay_<name>``; batches a relay
# wrote to its spool are delayed, not lost.
SPOOLED_COUNTER = "relay_spooled_batches"


def open_database(path: str) -> sqlite3.Connection:
    """A read-only connection any one worker thread may use; DatabaseMissing names a missing path."""
    if not os.path.exists(path):
        raise DatabaseMissing(f"no TraceML database at {path!r} (start `traceml-daemon serve --db {path}`)")
    return connect(path, any_thread=True)


def read_runs(path: str) -> tuple[list[RunInfo], RunRef | None]:
    """Every run of the database and the latest, for the run picker (a connection of its own)."""
    con = open_database(path)
    try:
        if not has_table(con, "ranks"):
            return [], None
        return run_infos(con), latest_run(con)
    finally:
        con.close()


def session_error(path: str, session: str) -> str | None:
    """Why ``tui --session`` cannot show ``session``: the database holds runs but not this
    one (the message names those it holds); None when it is there, or when nothing is
    stored yet (a live view may open before the job's first rank)."""
    con = open_database(path)
    try:
        if not has_table(con, "ranks"):
            return None
        resolve_run(con, session)
    except UnknownSession as exc:
        return None if not exc.known else str(exc)
    finally:
        con.close()
    return None


class TuiData:
    """A read-only reader of one database, cheap to refresh repeatedly.

    Not thread-safe: the app calls it from one worker at a time.
    """

    def __init__(
        self,
        path: str,
        *,
        window: int = WINDOW,
        series_points: int = SERIES_POINTS,
        clock: Callable[[], float] | None = None,
        slow_every: int = 5,
        session: str | None = None,
    ) -> None:
        self.path = path
        self.con = open_database(path)
        # ``session``: pinned (``tui --session``); None follows the latest run without
        # jumping to jobs that start later (``tui.follow``).
        self.choice = RunChoice(session)
        self.window = window
        self.series_points = series_points
        self.clock = clock if clock is not None else time.time
        # Things that change slowly (parallelism, the whole-run history series, delivery
        # counters) are re-read on the first refresh and every ``slow_every``-th one after.
        self.slow_every = max(1, slow_every)
        self._ranks: dict[int, LiveRank] = {}
        self._run: RunRef | None = None
        self._steps_rowid: int | None = None  # tails start past these; None until the first load
        self._status_rowid = 0
        self._series = details.SeriesCache(self.con, series_points)
        self._refreshes = 0
        self._parallelism = "single"
        self._last_seen: float | None = None
        self._history: bool | None = None  # unknown until the first read
        self._span: history.RunSpan | None = None
        self._hist_series: Series | None = None
        self._delivery_seen: Delivery | None = None
        # ``changed()`` runs on the UI thread while a worker may be reading on ``con``:
        # it gets a connection of its own (data_version is per connection anyway).
        self._watch = connect(path, any_thread=True)
        self._version: int | None = None

    def close(self) -> None:
        self.con.close()
        self._watch.close()

    def changed(self) -> bool:
        """Whether anything was committed since the previous call (the first call: True).

        ``PRAGMA data_version`` compares a counter in the WAL index: a few
        microseconds and no table read, so the app can ask many times a second.
        """
        try:
            version = data_version(self._watch)
        except sqlite3.Error:
            return True  # let a read meet the problem and show it
        changed = version != self._version
        self._version = version
        return changed

    # ---- the ranks' live state

    def _sync(self) -> None:
        # One read transaction: the windows and the rowid cursors see the same snapshot.
        with snapshot(self.con):
            self._load_ranks()
            self._tail()

    @property
    def run(self) -> RunRef | None:
        """The run shown (None until one is stored); the analyzer reads the same one."""
        return self._run

    def select(self, session: str | None) -> None:
        """Show ``session`` from the next read (None: follow the latest run); UI thread."""
        self.choice.request(session)

    def _load_ranks(self) -> None:
        run = self.choice.choose(self.con)
        if run is None:
            return
        if run != self._run:  # a restart, or another run picked: start over
            self._run = run
            self._ranks = {}
            self._series.clear()
            self._steps_rowid = None
            self._status_rowid = 0
            self._span = None
            self._hist_series = None
            self._parallelism = "single"
        # Only senders not seen yet are read row by row; liveness needs just the newest last_seen.
        known = max(self._ranks, default=0)
        new = reader.load_ranks(self.con, run, after=known)
        for rank in new:
            self._ranks[rank.rank_id] = LiveRank.of(rank, self.window)
        self._last_seen = run_last_seen(self.con, run)
        if new:
            self._initial_windows(run, known)
        if new or self._refreshes % self.slow_every == 0:
            # Models are reported after hello (hello often says "single"): re-read now and then.
            self._parallelism = run_parallelism(self.con, run)

    def _initial_windows(self, run: RunRef, after: int) -> None:
        if self._steps_rowid is None:  # the tails start at what is committed now
            self._steps_rowid, self._status_rowid = steps.last_rowids(self.con)
        # Three statements for all new ranks, not three per rank. Their rows past the
        # cursor are the tail's, so none enters a window twice.
        for rank_id, lo, hi in steps.step_bounds(self.con, run, after):
            st = self._ranks.get(rank_id)
            if st is not None:
                st.first_step, st.last_step = lo, hi
        rows: dict[int, list[tuple[Any, ...]]] = {}
        for row in steps.recent_steps(self.con, run, self.window, after, through_rowid=self._steps_rowid):
            rows.setdefault(row[0], []).append(row[1:])
        for rank_id, window in rows.items():
            st = self._ranks.get(rank_id)
            if st is not None:
                window.sort(key=lambda r: r[0])
                st.add(window)
        for row in steps.latest_status(self.con, run, after):
            st = self._ranks.get(row[0])
            if st is not None:
                st.set_status(steps.status_from_row(row[1:]))

    def _tail(self) -> None:
        if self._steps_rowid is None:
            return
        ranks = self._ranks
        new: dict[int, list[tuple[Any, ...]]] = {}
        last = self._steps_rowid
        for row in steps.steps_after(self.con, last):
            last = row[0]
            if row[1] in ranks:
                new.setdefault(row[1], []).append(row[2:])
        self._steps_rowid = last
        for rank_id, rows in new.items():
            ranks[rank_id].add(rows)
        last = self._status_rowid
        for row in steps.status_after(self.con, last):
            last = row[0]
            st = ranks.get(row[1])
            if st is not None:
                st.set_status(steps.status_from_row(row[2:]))
        self._status_rowid = last

    # ---- the header

    def _delivery(self, slow: bool) -> Delivery:
        # Every sender's counters are summed here, as costly as the rest of a refresh at
        # a thousand ranks. They are cumulative and change slowly, so they are re-read on
        # slow refreshes only (the first, then every ``slow_every``-th).
        if self._delivery_seen is None or slow:
            self._delivery_seen = self._read_delivery()
        return self._delivery_seen

    def _read_delivery(self) -> Delivery:
        if not has_table(self.con, "delivery"):
            return Delivery()
        flat = delivery.delivery_counters(self.con)
        # delivery_counters starts the daemon's counters at 0; before the daemon
        # stored any they are not measured, not zero.
        daemon = delivery.has_daemon_counters(self.con)

        def own(name: str) -> int | None:
            return int(flat.get(name, 0)) if daemon else None

        return Delivery(
            frames_received=own("frames_received"),
            rows_stored=own("rows_stored"),
            duplicates_discarded=own("duplicates_discarded"),
            rows_dropped=int(flat.get("rows_dropped_reported", 0)),
            batches_dropped=int(flat.get("batches_dropped_reported", 0)),
            spooled=int(flat.get(SPOOLED_COUNTER, 0)),
            counters=flat,
        )

    def _header(self, span: history.RunSpan | None, slow: bool) -> JobHeader:
        states = list(self._ranks.values())
        now = self.clock()
        first = min((s.first_seen for s in states if s.first_seen is not None), default=None)
        last = self._last_seen
        if span is not None:  # the history knows the run's first and last step times
            first = span.first_ts if span.first_ts is not None else first
            ends = [x for x in (last, span.last_ts) if x is not None]
            last = max(ends) if ends else None
        finished = bool(states) and all(s.status is not None and s.status.finished for s in states)
        live = not finished and self._last_seen is not None and now - self._last_seen < LIVE_SILENCE_S
        uptime = None if first is None else ((now if live else (last or first)) - first)
        latest = max((s.last_step for s in states if s.last_step is not None), default=None)
        if span is not None and span.last_step is not None:
            latest = span.last_step if latest is None else max(latest, span.last_step)
        # Pace over the recent window of the lowest rank that has one.
        pace = next((p for s in sorted(states, key=lambda s: s.global_rank) if (p := s.steps_per_s()) is not None), None)
        return JobHeader(
            session=self._run.session if self._run else "—",
            attempt=self._run.attempt if self._run else 0,
            nnodes=len({s.node_rank for s in states}),
            world_size=len(states),
            parallelism=self._parallelism,
            latest_step=latest,
            steps_per_s=pace,
            uptime_s=uptime,
            live=live,
            delivery=self._delivery(slow),
            first_step=span.first_step if span is not None else None,
            history=span is not None,
        )

    # ---- whole-run history (v2)

    def _history_span(self, slow: bool) -> history.RunSpan | None:
        """The run's span from the history tables, None on a v1 database or before any step.

        ``run_span`` reads a few rows per node; its last step is then kept current
        from the live tail, and it is re-read only on slow refreshes.
        """
        if self._history is None or (slow and not self._history):  # the daemon may migrate a v1 db
            self._history = history.has_history(self.con)
        if not self._history or self._run is None:
            return None
        if self._span is None or slow:
            span = history.run_span(self.con, self._run)
            self._span = span if span.first_step is not None else None
        if self._span is None:
            return None
        latest = max((s.last_step for s in self._ranks.values() if s.last_step is not None), default=None)
        if latest is not None and (self._span.last_step is None or latest > self._span.last_step):
            self._span = replace(self._span, last_step=latest)
        return self._span

    def _history_series(self, span: history.RunSpan, slow: bool) -> Series:
        """The whole run's step time across ranks (mean per point), <= series_points points.

        The history's levels are 64/1024/16384 steps, so asking for exactly
        ``series_points`` often lands on the coarsest level (13 points for 200k
        steps). Asking for up to 10x more picks a finer level, then the points
        are averaged down here; the factor shrinks with the node count so the
        read stays at a few thousand node_history rows.
        """
        if self._hist_series is None or slow:
            assert self._run is not None
            nnodes = max(1, len({s.node_rank for s in self._ranks.values()}))
            width = self.series_points * max(1, min(10, 8192 // (nnodes * self.series_points)))
            points = history.run_series(self.con, self._run, width, span)
            self._hist_series = downsample(
                [float(p.last_step) if p.last_step is not None else 0.0 for p in points],
                [p.mean_ms.get("step") for p in points],
                self.series_points,
            )
        return self._hist_series

    def _prefer_history(self, series: Series, span: history.RunSpan | None, first_rank: LiveRank | None) -> bool:
        """Draw the history's series unless it is coarse and the raw steps tell more."""
        if len(series.values) >= MIN_HISTORY_POINTS or span is None or first_rank is None:
            return True
        first = first_rank.first_step
        # Raw rows no longer reach the run's start (retention): only the history covers it.
        return first is None or span.first_step is None or first > span.first_step

    # ---- public snapshots

    def overview(self, analysis: Analysis | None = None) -> Overview:
        """One refresh of the overview; ``analysis`` (from ``Analyzer``) fills findings and worst ranks."""
        slow = self._refreshes % self.slow_every == 0
        with snapshot(self.con):
            self._load_ranks()
            self._tail()
            span = self._history_span(slow)
            series: Series | None = self._history_series(span, slow) if span is not None else None
        self._refreshes += 1
        ordered = sorted(self._ranks.values(), key=lambda s: s.global_rank)
        rows = [st.row() for st in ordered]
        lowest = ordered[0] if ordered else None
        if series is not None and series.values and self._prefer_history(series, span, lowest):
            label = "all ranks"  # whole run, from the downsampled history; fits the 11-column label
        else:
            series = self._series.step_ms(lowest.rank_id) if lowest else Series()
            label = f"step r{lowest.global_rank}" if lowest else "step"
        ov = Overview(
            header=self._header(span, slow),
            ranks=rows,
            nodes=nodes_from(rows),
            step_series=series,
            series_label=label,
            verdicts=[],
            verdicts_available=False,
            new_runs=self.choice.new_runs,
        )
        return with_analysis(ov, analysis)

    def step_series(self, rank_id: int) -> Series:
        """A rank's step time (ms) over the run, at most ``series_points`` points."""
        return self._series.step_ms(rank_id)

    def node_detail(self, node_rank: int) -> NodeDetail | None:
        self._sync()
        ranks = sorted((s for s in self._ranks.values() if s.node_rank == node_rank), key=lambda s: s.global_rank)
        return details.node_detail(self.con, self._series, node_rank, ranks) if ranks else None

    def rank_detail(self, global_rank: int) -> RankDetail | None:
        self._sync()
        rank = next((s for s in self._ranks.values() if s.global_rank == global_rank), None)
        return None if rank is None else details.rank_detail(self.con, self._series, rank)
