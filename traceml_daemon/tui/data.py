"""Read-only data access for the TUI (stdlib sqlite3 only, no textual).

Opens the database with ``file:PATH?mode=ro`` so it never blocks the daemon's
writer (WAL) and works the same on a finished run. Every query is bounded:

* per-rank windows of the most recent ``window`` steps are loaded once through
  the steps index (``schema.rank_is``) and then extended incrementally by ``rowid``
  (rows are only ever appended, so ``rowid > last`` is exactly "what is new");
* series are aggregated in SQL (``GROUP BY step / bucket``) into power-of-two
  buckets that are cached and merged pairwise, so a refresh only aggregates the
  steps written since the previous one and never returns more than W points;
* process/system/gpu series read the last W samples through their index;
* reads are set-based: the first load is one statement per table for all ranks
  (a correlated ``MAX(step)`` per rank is one index seek), never one per rank;
* with the v2 history tables the run's span comes from ``store.history``, and
  so does its sparkline (a cross-rank series over the whole run, O(width)
  rows) once the history has ``MIN_HISTORY_POINTS`` points or retention has
  deleted the run's first raw steps; a younger run draws its lowest rank's
  raw steps, which are then fewer than 64 x ``MIN_HISTORY_POINTS``;
* delivery counters go through ``store.reader.delivery_counters``, the
  summary's definition of rows and batches lost;
* diagnosis and node views (``analysis.nodes.node_views``: the worst rank is
  the one with the most busy time) run in ``Analyzer``, on its own connection,
  so the app can run them in their own worker at a lower rate; it judges the
  newest host/GPU samples of every node (``store.reader.load_systems``) too.

Everything returned is a plain dataclass; ``None`` always means "not measured".
"""

from __future__ import annotations

import math
import os
import sqlite3
import time
from bisect import bisect_left, insort
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from traceml_daemon.analysis.model import PHASES, RankData, RankStatus, RunData, Verdict
from traceml_daemon.analysis.nodes import node_views
from traceml_daemon.ingest.counters import DAEMON_SOURCE
from traceml_daemon.store import history
from traceml_daemon.store.reader import RunRef, delivery_counters, latest_run, load_systems, run_parallelism
from traceml_daemon.store.schema import rank_is

WINDOW = 32  # recent steps per rank kept in memory for medians and diagnosis
SERIES_POINTS = 120  # default W for downsampled series
NODE_SPARK_RANKS = 64  # step sparklines drawn on a node screen; the screen says when there are more
# The history's finest level holds 64 steps a point, so a young run has a handful of
# points there: below this many the lowest rank's raw steps (fewer than 64 x this many
# rows, so the read stays bounded) draw a finer line, unless retention already deleted
# the run's first raw steps and only the history still covers them.
MIN_HISTORY_POINTS = 32
# ``store.reader.delivery_counters`` sums every relay counter under ``relay_<name>``;
# batches a relay wrote to its spool are delayed, not lost.
SPOOLED_COUNTER = "relay_spooled_batches"
_STEP_COLS = (
    ("step", "ts", "step_ns")
    + tuple(f"{p}_ns" for p in PHASES)
    + (
        "comm_ns",
        "peak_bytes",
        "reserved_bytes",
        "rss_bytes",
    )
)
_MEDIAN_COLS = tuple(range(2, 3 + len(PHASES)))  # step_ns, then PHASES in order


class DatabaseMissing(FileNotFoundError):
    """The database path does not exist (raised with the path in the message)."""


# ---------------------------------------------------------------- dataclasses


@dataclass(frozen=True)
class Series:
    """A downsampled series: ``steps[i]`` is the last step (or ts) of point i."""

    steps: list[float] = field(default_factory=list)
    values: list[float | None] = field(default_factory=list)

    def last(self) -> float | None:
        return self.values[-1] if self.values else None


@dataclass(frozen=True)
class Delivery:
    """Delivery counters as the summary reports them (``store.reader.delivery_counters``).

    Rows and batches stay apart: a lost batch holds an unknown number of rows,
    so the two never add up to one figure.
    """

    frames_received: int | None = None  # None: the daemon has stored no counters yet
    rows_stored: int | None = None
    duplicates_discarded: int | None = None
    rows_dropped: int = 0  # rows_dropped_reported: rows an agent counted as lost
    batches_dropped: int = 0  # batches_dropped_reported: agent sender and relay batches lost
    spooled: int = 0  # batches relays spooled to disk (delayed, not lost)
    counters: dict[str, int] = field(default_factory=dict)  # delivery_counters() as returned

    @property
    def lost(self) -> bool:
        return bool(self.rows_dropped or self.batches_dropped)


@dataclass(frozen=True)
class JobHeader:
    session: str
    attempt: int
    nnodes: int
    world_size: int
    parallelism: str  # store.reader.run_parallelism: traced models first, hello identity second
    latest_step: int | None
    steps_per_s: float | None
    uptime_s: float | None
    live: bool
    delivery: Delivery
    first_step: int | None = None  # the run's span, from the history tables when present
    history: bool = False  # True when span and sparkline cover the whole run (v2 history)


@dataclass(frozen=True)
class RankRow:
    rank_id: int
    global_rank: int
    local_rank: int | None
    node_rank: int
    hostname: str | None
    steps: int  # steps stored for this rank (first..last, index bounds)
    last_step: int | None
    step_ms: float | None  # median over the recent window
    phase_ms: dict[str, float | None]
    rss_bytes: int | None
    peak_bytes: int | None
    status_phase: str | None = None


@dataclass(frozen=True)
class NodeRow:
    node_rank: int
    hostname: str | None
    ranks: int
    median_ms: float | None  # median of the node's rank step medians (recent window)
    # From analysis.nodes.node_views, the one definition shared with the summary:
    # worst = most busy time (step minus all-reduce wait), since under DDP every
    # rank reports the same step time. None until the analyzer has run.
    worst_rank: int | None = None
    worst_busy_ms: float | None = None
    busy_median_ms: float | None = None
    skew_pct: float | None = None  # (worst busy - node busy median) / node busy median


@dataclass(frozen=True)
class Overview:
    header: JobHeader
    ranks: list[RankRow]
    nodes: list[NodeRow]
    step_series: Series  # run step time (ms): whole run across ranks (history), else the lowest rank
    series_label: str  # what step_series covers, for the sparkline's label
    verdicts: list[Verdict]
    verdicts_available: bool  # False until an analysis ran with the engine present


@dataclass(frozen=True)
class Analysis:
    """What the analyzer produced from one consistent read of the recent windows."""

    verdicts: list[Verdict] = field(default_factory=list)
    available: bool = False  # False: the analysis engine is absent
    nodes: dict[int, dict[str, Any]] = field(default_factory=dict)  # node_rank -> node_views() entry
    parallelism: str = "single"


@dataclass(frozen=True)
class SystemLatest:
    cpu_pct: float | None = None
    mem_used_bytes: int | None = None
    mem_total_bytes: int | None = None
    net_rx_bps: float | None = None
    net_tx_bps: float | None = None
    cpu_series: Series = field(default_factory=Series)


@dataclass(frozen=True)
class GpuLatest:
    gpu_index: int
    util_pct: float | None
    mem_used_bytes: int | None
    mem_total_bytes: int | None
    temp_c: float | None
    power_w: float | None


@dataclass(frozen=True)
class NodeDetail:
    node_rank: int
    hostname: str | None
    ranks: list[RankRow]
    step_series: dict[int, Series]  # global rank -> step ms; the first NODE_SPARK_RANKS ranks only
    system: SystemLatest | None  # None: no host sampler rows for this node
    gpus: list[GpuLatest]


@dataclass(frozen=True)
class ProcessLatest:
    cpu_pct: float | None
    rss_bytes: int | None
    gpu_mem_bytes: int | None
    threads: int | None
    cpu_series: Series


@dataclass(frozen=True)
class LayerRow:
    layer: str
    forward_ms: float | None
    backward_ms: float | None
    activation_bytes: int | None


@dataclass(frozen=True)
class ModelRow:
    model_id: int | None
    name: str | None
    parallelism: str | None
    n_modules: int | None
    param_bytes: int | None
    local_shard_bytes: int | None
    estimated_full_bytes: int | None


@dataclass(frozen=True)
class RankDetail:
    row: RankRow
    phase_series: dict[str, Series]  # phase -> ms
    memory_series: dict[str, Series]  # peak/reserved/rss -> bytes
    process: ProcessLatest | None
    scalars: dict[str, tuple[float | None, Series]]  # name -> (latest, series)
    layers_step: int | None
    layers: list[LayerRow]
    models: list[ModelRow]


# ---------------------------------------------------------------- helpers


def median(values: Iterable[float | int | None]) -> float | None:
    """Median of the measured values (None ignored); None when nothing measured."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    n = len(xs)
    mid = n // 2
    return float(xs[mid]) if n % 2 else (xs[mid - 1] + xs[mid]) / 2.0


def _ms(ns: float | None) -> float | None:
    return None if ns is None else ns / 1e6


def downsample(steps: Sequence[float], values: Sequence[float | None], width: int) -> Series:
    """Bucket-average an in-memory series to at most ``width`` points.

    The last point always carries the last input step, so the latest value is
    never lost; buckets with no measured value stay None.
    """
    n = len(steps)
    if width <= 0 or n == 0:
        return Series()
    if n <= width:
        return Series(list(steps), list(values))
    size = math.ceil(n / width)
    # Align buckets to the end so the final bucket holds the latest step.
    start = n - size * math.ceil(n / size)
    out_s: list[float] = []
    out_v: list[float | None] = []
    for lo in range(start, n, size):
        chunk = [v for v in values[max(lo, 0) : lo + size] if v is not None]
        out_s.append(steps[min(lo + size, n) - 1])
        out_v.append(sum(chunk) / len(chunk) if chunk else None)
    return Series(out_s, out_v)


class _Buckets:
    """Cached SQL aggregation of one ``(table, rank_id[, name])`` series.

    ``where`` selects the series' rows with numbered parameters (``?1``...: it is used
    twice in one statement), ``schema.rank_is`` for the rank.

    Buckets are ``step // size`` with ``size`` a power of two; when there are
    more than ``width`` buckets, neighbours are merged pairwise (size doubles),
    which needs no re-read. Only the newest (possibly partial) bucket is
    re-aggregated on each update.
    """

    def __init__(self, table: str, cols: Sequence[str], where: str, params: tuple[Any, ...], width: int) -> None:
        self.table = table
        self.cols = tuple(cols)
        self.where = where
        self.params = params
        self.width = max(1, width)
        self.size = 0  # unknown until the first update
        # key -> [count, max_step, sum_c..., n_c...]
        self.buckets: dict[int, list[float]] = {}

    def update(self, con: sqlite3.Connection) -> None:
        if self.size == 0:
            # Two subqueries: each is one seek of the index (MIN and MAX in one SELECT walk
            # every entry of the rank's group).
            lo, hi = con.execute(
                f"SELECT (SELECT MIN(step) FROM {self.table} WHERE {self.where}), "
                f"(SELECT MAX(step) FROM {self.table} WHERE {self.where})",
                self.params,
            ).fetchone()
            if lo is None:
                return
            span = max(1, hi - lo + 1)
            self.size = 1 << max(0, math.ceil(math.log2(max(1.0, span / self.width))))
        start = (max(self.buckets) * self.size) if self.buckets else -(1 << 62)
        aggs = ", ".join(f"SUM({c}), COUNT({c})" for c in self.cols)
        sql = (
            f"SELECT step / {self.size} AS k, COUNT(*), MAX(step), {aggs} FROM {self.table} "
            f"WHERE {self.where} AND step >= ? GROUP BY k"
        )
        for row in con.execute(sql, (*self.params, start)):
            self.buckets[int(row[0])] = [float(x) if x is not None else 0.0 for x in row[1:]]
        while len(self.buckets) > self.width:
            self._merge()

    def _merge(self) -> None:
        merged: dict[int, list[float]] = {}
        for k in sorted(self.buckets):
            b = self.buckets[k]
            m = merged.get(k // 2)
            if m is None:
                merged[k // 2] = list(b)
            else:
                m[0] += b[0]
                m[1] = max(m[1], b[1])
                for i in range(2, len(b)):
                    m[i] += b[i]
        self.buckets = merged
        self.size *= 2

    def series(self, col: int = 0, scale: float = 1.0) -> Series:
        steps: list[float] = []
        values: list[float | None] = []
        for k in sorted(self.buckets):
            b = self.buckets[k]
            total, n = b[2 + 2 * col], b[3 + 2 * col]
            steps.append(int(b[1]))
            values.append(total / n * scale if n else None)
        return Series(steps, values)


@dataclass
class _RankState:
    """In-memory view of one rank: identity and its recent steps window."""

    rank_id: int
    global_rank: int
    local_rank: int | None
    node_rank: int
    hostname: str | None
    first_seen: float | None
    last_seen: float | None
    window: dict[int, tuple[Any, ...]] = field(default_factory=dict)  # step -> row (_STEP_COLS)
    first_step: int | None = None
    last_step: int | None = None
    status: RankStatus | None = None
    row: RankRow | None = None  # cache, reset when the window or the status changes
    # The window's measured step and phase values, each column kept sorted as rows come
    # and go: a refresh at 1024 ranks then costs a few inserts per rank, not 7 sorts.
    ordered: list[list[Any]] = field(default_factory=lambda: [[] for _ in _MEDIAN_COLS])

    def put(self, data: tuple[Any, ...]) -> None:
        """Add (or replace) the window row of step ``data[0]``."""
        old = self.window.get(data[0])
        if old is not None:
            _drop_values(self.ordered, old)
        self.window[data[0]] = data
        for xs, i in zip(self.ordered, _MEDIAN_COLS, strict=True):
            v = data[i]
            if v is not None:
                insort(xs, v)
        self.row = None

    def trim(self, keep: int) -> None:
        """Forget the oldest rows beyond ``keep``."""
        extra = len(self.window) - keep
        if extra <= 0:
            return
        for step in sorted(self.window)[:extra] if extra > 1 else (min(self.window),):
            _drop_values(self.ordered, self.window.pop(step))
        self.row = None

    def medians(self) -> tuple[float | None, dict[str, float | None]]:
        """Step and phase medians (ms) of the window (None: nothing measured)."""
        out: list[float | None] = []
        for xs in self.ordered:
            n = len(xs)
            if not n:
                out.append(None)
                continue
            mid = n // 2
            out.append((xs[mid] if n % 2 else (xs[mid - 1] + xs[mid]) / 2.0) / 1e6)
        return out[0], dict(zip(PHASES, out[1:], strict=True))


def _drop_values(ordered: list[list[Any]], data: tuple[Any, ...]) -> None:
    for xs, i in zip(ordered, _MEDIAN_COLS, strict=True):
        v = data[i]
        if v is not None:
            j = bisect_left(xs, v)
            if j < len(xs) and xs[j] == v:
                del xs[j]


# ---------------------------------------------------------------- set-based reads

_RUN_RANKS = "r.session=? AND r.attempt=? AND r.rank_id>?"


def current_run(con: sqlite3.Connection) -> tuple[str, int] | None:
    """The run the summary reports too (``store.reader.latest_run``): the session seen
    most recently, at its highest attempt. A late resend from an earlier attempt (an
    elastic restart) refreshes that attempt's last_seen but must not switch the view."""
    if con.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='ranks'").fetchone() is None:
        return None
    run = latest_run(con)
    return None if run is None else (run.session, run.attempt)


def read_bounds(con: sqlite3.Connection, run: tuple[str, int], after: int = 0) -> Iterator[tuple[int, Any, Any]]:
    """(rank_id, first step, last step) of every rank of ``run`` with rank_id > ``after``.

    One statement: each correlated MIN/MAX is a seek of the steps index.
    """
    return con.execute(
        f"SELECT r.rank_id, (SELECT MIN(step) FROM steps s WHERE {rank_is('r.rank_id', 's.rank_id')}), "
        f"(SELECT MAX(step) FROM steps s WHERE {rank_is('r.rank_id', 's.rank_id')}) "
        f"FROM ranks r WHERE {_RUN_RANKS}",
        (*run, after),
    )


def read_windows(
    con: sqlite3.Connection, run: tuple[str, int], window: int, after: int = 0
) -> Iterator[tuple[Any, ...]]:
    """(rank_id, *_STEP_COLS) of the newest ``window`` steps of every rank of ``run``.

    One statement for all ranks: the per-rank MAX(step) bounds an index range
    scan, so it reads ``window`` rows per rank whatever the run's length.
    """
    cols = ", ".join(f"s.{c}" for c in _STEP_COLS)
    return con.execute(
        f"SELECT s.rank_id, {cols} FROM ranks r CROSS JOIN steps s "
        f"WHERE {_RUN_RANKS} AND {rank_is('r.rank_id', 's.rank_id')} "
        f"AND s.step > (SELECT MAX(step) FROM steps m WHERE {rank_is('r.rank_id', 'm.rank_id')}) - ?",
        (*run, after, window),
    )


def read_status(con: sqlite3.Connection, run: tuple[str, int], after: int = 0) -> Iterator[tuple[Any, ...]]:
    """(rank_id, ts, phase, phase_since, step, steps_done, finished): each rank's newest status row."""
    return con.execute(
        "SELECT st.rank_id, st.ts, st.phase, st.phase_since, st.step, st.steps_done, st.finished "
        f"FROM ranks r CROSS JOIN status st WHERE {_RUN_RANKS} AND st.rowid = "
        "(SELECT x.rowid FROM status x WHERE x.rank_id=r.rank_id ORDER BY x.ts DESC LIMIT 1)",
        (*run, after),
    )


def has_history(con: sqlite3.Connection) -> bool:
    """The v2 history tables exist (a v1 database falls back to raw reads)."""
    row = con.execute(
        "SELECT count(*) FROM sqlite_master WHERE type='table' AND name IN ('node_history', 'reservoir')"
    ).fetchone()
    return bool(row and row[0] == 2)


def load_window_run(con: sqlite3.Connection, window: int = WINDOW, now: float | None = None) -> RunData:
    """The analysis input over each rank's newest ``window`` steps (set-based reads),
    plus each node's newest ``window`` host and GPU samples (``store.reader.load_systems``:
    two index seeks per rank, about 0.2 s of CPU at 4096 ranks of 8 GPUs each).

    Call inside a read transaction for a consistent snapshot.
    """
    run = current_run(con)
    if run is None:
        return RunData(ranks=[])
    ranks: dict[int, RankData] = {}
    for rid, g, local, node, host in con.execute(
        "SELECT rank_id, global_rank, local_rank, node_rank, hostname FROM ranks r "
        f"WHERE {_RUN_RANKS} ORDER BY global_rank, rank_id",
        (*run, 0),
    ):
        ranks[rid] = RankData(
            global_rank=int(g if g is not None else rid),
            local_rank=local,
            node_rank=node,
            hostname=host,
            phases_ns={p: [] for p in PHASES},
        )
    rows: dict[int, list[tuple[Any, ...]]] = {}
    for row in read_windows(con, run, window):
        rows.setdefault(row[0], []).append(row[1:])
    for rid, rs in rows.items():
        rd = ranks.get(rid)
        if rd is None:
            continue
        rs.sort(key=lambda r: r[0])
        cols = list(zip(*rs, strict=True))
        rd.steps = list(cols[0])
        rd.step_ts = list(cols[1])
        rd.step_ns = list(cols[2])
        rd.phases_ns = {p: list(cols[3 + i]) for i, p in enumerate(PHASES)}
        rd.comm_ns, rd.peak_bytes, rd.reserved_bytes, rd.rss_bytes = (list(c) for c in cols[9:13])
    for row in read_status(con, run):
        rd = ranks.get(row[0])
        if rd is not None:
            rd.status = _status(row[1:])
    out = list(ranks.values())
    live = bool(out) and not all(r.status is not None and r.status.finished for r in out)
    ref = RunRef(*run)
    parallelism = run_parallelism(con, ref)
    # Host and GPU samples through the summary's own loader, so the per-node findings
    # are judged alike; only the newest ``window`` samples per node (like the steps), which
    # keeps the read bounded: 4096 ranks of 8 GPUs each are ~130k values, not ~500k.
    systems = load_systems(con, ref, last_n=window)
    return RunData(ranks=out, parallelism=parallelism, now=now if live else None, live=live, systems=systems)


class Analyzer:
    """Diagnosis and node views over the recent windows, on a connection of its own.

    Costly at scale (hundreds of ms at 4096 ranks), so the app runs it in its
    own worker at a lower rate than the refresh; never shares ``TuiData``'s
    connection, so the two workers may run at the same time.
    """

    def __init__(self, path: str, *, window: int = WINDOW, clock: Any = None) -> None:
        if not os.path.exists(path):
            raise DatabaseMissing(f"no TraceML database at {path!r}")
        self.con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
        self.window = window
        self.clock = clock if clock is not None else time.time

    def close(self) -> None:
        self.con.close()

    def run(self) -> Analysis:
        self.con.execute("BEGIN")
        try:
            run = load_window_run(self.con, self.window, self.clock())
        finally:
            self.con.execute("COMMIT")
        views = {int(v["node_rank"]): v for v in node_views(run)}
        try:
            from traceml_daemon.analysis.engine import diagnose  # optional: the UI works without it
        except ImportError:
            return Analysis([], False, views, run.parallelism)
        try:
            verdicts = list(diagnose(run))
        except Exception as exc:  # a diagnosis bug must not take the UI down
            verdicts = [Verdict("DIAGNOSIS_ERROR", "warn", {}, f"analysis failed: {exc.__class__.__name__}: {exc}")]
        order = {"critical": 0, "warn": 1, "info": 2}
        verdicts.sort(key=lambda v: order.get(v.severity, 3))
        return Analysis(verdicts, True, views, run.parallelism)


def nodes_from(rows: list[RankRow], analysis: Analysis | None = None) -> list[NodeRow]:
    """Node table rows: live step medians from ``rows``, worst rank and busy time from ``analysis``."""
    by_node: dict[int, list[RankRow]] = {}
    for r in rows:
        by_node.setdefault(r.node_rank, []).append(r)
    views = analysis.nodes if analysis is not None else {}
    out: list[NodeRow] = []
    for node, rs in by_node.items():
        view = views.get(node)
        worst = view["worst_rank"] if view else None
        busy_med = view["busy_ms_median"] if view else None
        worst_busy = worst["busy_ms_median"] if worst else None
        skew = None
        if worst_busy is not None and busy_med:
            skew = (worst_busy - busy_med) / busy_med * 100.0
        out.append(
            NodeRow(
                node_rank=node,
                hostname=rs[0].hostname,
                ranks=len(rs),
                median_ms=median(r.step_ms for r in rs),
                worst_rank=worst["global_rank"] if worst else None,
                worst_busy_ms=worst_busy,
                busy_median_ms=busy_med,
                skew_pct=skew,
            )
        )
    # Worst first by busy time (step minus wait), then step median. Under DDP every
    # node's step median is the same up to noise (the all-reduce waits for the slowest),
    # so ordering by it flipped the two nodes of the demo between refreshes; busy time
    # is what the slow node has more of, and without synchronization it is the step.
    out.sort(
        key=lambda n: (
            n.busy_median_ms is None and n.median_ms is None,
            -(n.busy_median_ms or 0.0),
            -(n.worst_busy_ms or 0.0),
            -(n.median_ms or 0.0),
            n.node_rank,
        )
    )
    return out


def with_analysis(ov: Overview, analysis: Analysis | None) -> Overview:
    """``ov`` with the findings, node worst ranks and parallelism of ``analysis`` (no db read)."""
    if analysis is None:
        return ov
    header = ov.header
    if analysis.parallelism != header.parallelism and analysis.parallelism != "single":
        header = replace(header, parallelism=analysis.parallelism)
    return replace(
        ov,
        header=header,
        nodes=nodes_from(ov.ranks, analysis),
        verdicts=list(analysis.verdicts),
        verdicts_available=analysis.available,
    )


# ---------------------------------------------------------------- the reader


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
        clock: Any = None,
        slow_every: int = 5,
    ) -> None:
        if not os.path.exists(path):
            raise DatabaseMissing(f"no TraceML database at {path!r} (start `traceml-daemon serve --db {path}`)")
        self.path = path
        # check_same_thread=False: the app reads from thread workers (one at a time).
        self.con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
        self.window = window
        self.series_points = series_points
        self.clock = clock if clock is not None else time.time
        # Things that change slowly (parallelism, the whole-run history series) are
        # re-read on the first refresh and every ``slow_every``-th one after.
        self.slow_every = max(1, slow_every)
        self._ranks: dict[int, _RankState] = {}
        self._session: tuple[str, int] | None = None
        self._steps_rowid = 0
        self._status_rowid = 0
        self._buckets: dict[tuple[Any, ...], _Buckets] = {}
        self._refreshes = 0
        self._parallelism = "single"
        self._last_seen: float | None = None
        self._history: bool | None = None  # unknown until the first read
        self._span: history.RunSpan | None = None
        self._hist_series: Series | None = None
        self._delivery_seen: Delivery | None = None  # re-read on slow refreshes (see _delivery)
        # ``changed()`` runs on the UI thread while a worker may be reading on ``con``:
        # it gets a connection of its own (data_version is per connection anyway).
        self._watch = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
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
            version = self._watch.execute("PRAGMA data_version").fetchone()[0]
        except sqlite3.Error:
            return True  # let a read meet the problem and show it
        changed = version != self._version
        self._version = version
        return changed

    # ---- identity and incremental windows

    def _has_table(self, name: str) -> bool:
        row = self.con.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?", (name,)).fetchone()
        return row is not None

    def _load_ranks(self) -> None:
        session = current_run(self.con)
        if session is None:
            return
        if session != self._session:  # a restart: start over with the new attempt
            self._session = session
            self._ranks = {}
            self._buckets = {}
            self._steps_rowid = 0
            self._status_rowid = 0
            self._span = None
            self._hist_series = None
            self._parallelism = "single"
        # Only senders not seen yet are read row by row; liveness needs just the newest last_seen.
        known = max(self._ranks, default=0)
        new: list[_RankState] = []
        for r in self.con.execute(
            "SELECT rank_id, global_rank, local_rank, node_rank, hostname, first_seen, last_seen "
            f"FROM ranks r WHERE {_RUN_RANKS} ORDER BY global_rank",
            (*session, known),
        ):
            st = _RankState(r[0], int(r[1] if r[1] is not None else r[0]), r[2], int(r[3] or 0), r[4], r[5], r[6])
            self._ranks[r[0]] = st
            new.append(st)
        self._last_seen = self.con.execute(
            "SELECT MAX(last_seen) FROM ranks WHERE session=? AND attempt=?", session
        ).fetchone()[0]
        if new:
            self._initial_windows(session, known)
        if new or self._refreshes % self.slow_every == 0:
            # Models are reported after hello (hello often says "single"): re-read now and then.
            self._parallelism = run_parallelism(self.con, RunRef(*session))

    def _initial_windows(self, session: tuple[str, int], after: int) -> None:
        # Three statements for all new ranks, not three per rank.
        for rid, lo, hi in read_bounds(self.con, session, after):
            st = self._ranks.get(rid)
            if st is not None:
                st.first_step, st.last_step = lo, hi
        for row in read_windows(self.con, session, self.window, after):
            st = self._ranks.get(row[0])
            if st is not None:
                st.put(row[1:])
        for row in read_status(self.con, session, after):
            st = self._ranks.get(row[0])
            if st is not None:
                st.status = _status(row[1:])
        if not self._steps_rowid:
            self._steps_rowid = self.con.execute("SELECT COALESCE(MAX(rowid), 0) FROM steps").fetchone()[0]
            self._status_rowid = self.con.execute("SELECT COALESCE(MAX(rowid), 0) FROM status").fetchone()[0]

    def _tail(self) -> None:
        cols = ", ".join(_STEP_COLS)
        touched: dict[int, _RankState] = {}
        last = self._steps_rowid
        ranks = self._ranks
        for row in self.con.execute(f"SELECT rowid, rank_id, {cols} FROM steps WHERE rowid>?", (self._steps_rowid,)):
            last = row[0]
            st = ranks.get(row[1])
            if st is None:
                continue
            data = row[2:]
            step = data[0]
            st.put(data)
            st.last_step = step if st.last_step is None or step > st.last_step else st.last_step
            st.first_step = step if st.first_step is None or step < st.first_step else st.first_step
            touched[row[1]] = st
        self._steps_rowid = last
        for st in touched.values():
            st.trim(self.window)
        last = self._status_rowid
        for row in self.con.execute(
            "SELECT rowid, rank_id, ts, phase, phase_since, step, steps_done, finished FROM status WHERE rowid>?",
            (self._status_rowid,),
        ):
            last = row[0]
            st = ranks.get(row[1])
            if st is not None and (st.status is None or row[2] >= st.status.ts):
                st.status = _status(row[2:])
                st.row = None
        self._status_rowid = last

    def _sync(self) -> None:
        # One read transaction: the windows and the rowid cursors see the same snapshot.
        self.con.execute("BEGIN")
        try:
            self._load_ranks()
            self._tail()
        finally:
            self.con.execute("COMMIT")

    # ---- rows

    def _rank_row(self, st: _RankState) -> RankRow:
        if st.row is not None:
            return st.row
        step_ms, phases = st.medians()
        latest = st.window.get(st.last_step) if st.last_step is not None else None
        steps = 0 if st.last_step is None or st.first_step is None else st.last_step - st.first_step + 1
        st.row = RankRow(
            rank_id=st.rank_id,
            global_rank=st.global_rank,
            local_rank=st.local_rank,
            node_rank=st.node_rank,
            hostname=st.hostname,
            steps=steps,
            last_step=st.last_step,
            step_ms=step_ms,
            phase_ms=phases,
            rss_bytes=latest[12] if latest else None,
            peak_bytes=latest[10] if latest else None,
            status_phase=st.status.phase if st.status else None,
        )
        return st.row

    def _delivery(self, slow: bool) -> Delivery:
        # Every sender's counters are summed here: ~20 ms at 1024 ranks, as much as the
        # rest of a refresh. They are cumulative and change slowly, so they are re-read
        # on slow refreshes only (the first, then every ``slow_every``-th).
        if self._delivery_seen is not None and not slow:
            return self._delivery_seen
        self._delivery_seen = self._read_delivery()
        return self._delivery_seen

    def _read_delivery(self) -> Delivery:
        if not self._has_table("delivery"):
            return Delivery()
        # The summary's definitions, not a second copy: which agent and relay counters
        # are rows lost, which are batches lost (a relay's dropped_bytes is neither).
        flat = delivery_counters(self.con)
        daemon = self.con.execute("SELECT 1 FROM delivery WHERE source=? LIMIT 1", (DAEMON_SOURCE,)).fetchone()

        def own(name: str) -> int | None:
            # delivery_counters starts the daemon's counters at 0; before the daemon
            # stored any they are not measured, not zero.
            return int(flat.get(name, 0)) if daemon is not None else None

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
        live = not finished and self._last_seen is not None and now - self._last_seen < 30.0
        uptime = None if first is None else ((now if live else (last or first)) - first)
        latest = max((s.last_step for s in states if s.last_step is not None), default=None)
        if span is not None and span.last_step is not None:
            latest = span.last_step if latest is None else max(latest, span.last_step)
        return JobHeader(
            session=self._session[0] if self._session else "—",
            attempt=self._session[1] if self._session else 0,
            nnodes=len({s.node_rank for s in states}),
            world_size=len(states),
            parallelism=self._parallelism,
            latest_step=latest,
            steps_per_s=self._steps_per_s(states),
            uptime_s=uptime,
            live=live,
            delivery=self._delivery(slow),
            first_step=span.first_step if span is not None else None,
            history=span is not None,
        )

    @staticmethod
    def _steps_per_s(states: list[_RankState]) -> float | None:
        # Rate over the recent window of the lowest rank: steps done / wall time between them.
        for st in sorted(states, key=lambda s: s.global_rank):
            steps = sorted(st.window)
            if len(steps) < 2:
                continue
            t0, t1 = st.window[steps[0]][1], st.window[steps[-1]][1]
            if t0 is None or t1 is None or t1 <= t0:
                continue
            return (steps[-1] - steps[0]) / (t1 - t0)
        return None

    @staticmethod
    def nodes_from(rows: list[RankRow], analysis: Analysis | None = None) -> list[NodeRow]:
        return nodes_from(rows, analysis)

    def _series(
        self, key: tuple[Any, ...], table: str, cols: Sequence[str], where: str, params: tuple[Any, ...]
    ) -> _Buckets:
        b = self._buckets.get(key)
        if b is None:
            b = _Buckets(table, cols, where, params, self.series_points)
            self._buckets[key] = b
        b.update(self.con)
        return b

    def step_series(self, rank_id: int) -> Series:
        return self._series(("steps", rank_id), "steps", ("step_ns",), rank_is("?1"), (rank_id,)).series(0, 1e-6)

    # ---- whole-run history (v2)

    def _history_span(self, slow: bool) -> history.RunSpan | None:
        """The run's span from the history tables, None on a v1 database or before any step.

        ``run_span`` reads a few rows per node; its last step is then kept current
        from the live tail, and it is re-read only on slow refreshes.
        """
        if self._history is None or (slow and not self._history):  # the daemon may migrate a v1 db
            self._history = has_history(self.con)
        if not self._history or self._session is None:
            return None
        if self._span is None or slow:
            span = history.run_span(self.con, *self._session)
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
            assert self._session is not None
            nnodes = max(1, len({s.node_rank for s in self._ranks.values()}))
            width = self.series_points * max(1, min(10, 8192 // (nnodes * self.series_points)))
            points = history.run_series(self.con, *self._session, width, span)
            self._hist_series = downsample(
                [float(p.last_step) if p.last_step is not None else 0.0 for p in points],
                [p.mean_ms.get("step") for p in points],
                self.series_points,
            )
        return self._hist_series

    def _prefer_history(self, series: Series, span: history.RunSpan | None, rows: list[RankRow]) -> bool:
        """Draw the history's series unless it is coarse and the raw steps tell more."""
        if len(series.values) >= MIN_HISTORY_POINTS or span is None or not rows:
            return True
        first = self._ranks[rows[0].rank_id].first_step
        # Raw rows no longer reach the run's start (retention): only the history covers it.
        return first is None or span.first_step is None or first > span.first_step

    # ---- public snapshots

    def overview(self, analysis: Analysis | None = None) -> Overview:
        """One refresh of the overview; ``analysis`` (from ``Analyzer``) fills findings and worst ranks."""
        slow = self._refreshes % self.slow_every == 0
        self.con.execute("BEGIN")
        try:
            self._load_ranks()
            self._tail()
            span = self._history_span(slow)
            series: Series | None = self._history_series(span, slow) if span is not None else None
        finally:
            self.con.execute("COMMIT")
        self._refreshes += 1
        rows = [self._rank_row(st) for st in sorted(self._ranks.values(), key=lambda s: s.global_rank)]
        if series is not None and series.values and self._prefer_history(series, span, rows):
            label = "all ranks"  # whole run, from the downsampled history; fits the 11-column label
        else:
            first = rows[0] if rows else None
            series = self.step_series(first.rank_id) if first else Series()
            label = f"step r{first.global_rank}" if first else "step"
        ov = Overview(
            header=self._header(span, slow),
            ranks=rows,
            nodes=nodes_from(rows),
            step_series=series,
            series_label=label,
            verdicts=[],
            verdicts_available=False,
        )
        return with_analysis(ov, analysis)

    def node_detail(self, node_rank: int) -> NodeDetail | None:
        self._sync()
        states = sorted((s for s in self._ranks.values() if s.node_rank == node_rank), key=lambda s: s.global_rank)
        if not states:
            return None
        rows = [self._rank_row(s) for s in states]
        # One bucketed series per rank: bounded so a 512-rank node stays one quick read;
        # NodeDetail.ranks still lists them all and the screen says how many have a line.
        sparks = {s.global_rank: self.step_series(s.rank_id) for s in states[:NODE_SPARK_RANKS]}
        system: SystemLatest | None = None
        gpus: list[GpuLatest] = []
        for s in states:  # the host sampler runs on the node's local rank 0; find whoever sent rows
            sys_rows = self.con.execute(
                "SELECT ts, cpu_pct, mem_used_bytes, mem_total_bytes, net_rx_bps, net_tx_bps FROM system "
                f"WHERE {rank_is('?1')} ORDER BY ts DESC LIMIT ?2",
                (s.rank_id, self.series_points),
            ).fetchall()
            if sys_rows and system is None:
                sys_rows.reverse()
                lt = sys_rows[-1]
                system = SystemLatest(
                    cpu_pct=lt[1],
                    mem_used_bytes=lt[2],
                    mem_total_bytes=lt[3],
                    net_rx_bps=lt[4],
                    net_tx_bps=lt[5],
                    cpu_series=Series([r[0] for r in sys_rows], [r[1] for r in sys_rows]),
                )
            if not gpus:
                seen: dict[int, GpuLatest] = {}
                for g in self.con.execute(
                    "SELECT gpu_index, util_pct, mem_used_bytes, mem_total_bytes, temp_c, power_w FROM gpu "
                    f"WHERE {rank_is('?1')} ORDER BY ts DESC LIMIT 256",
                    (s.rank_id,),
                ):
                    if g[0] not in seen:
                        seen[g[0]] = GpuLatest(*g)
                gpus = [seen[k] for k in sorted(seen)]
        return NodeDetail(node_rank, states[0].hostname, rows, sparks, system, gpus)

    def rank_detail(self, global_rank: int) -> RankDetail | None:
        self._sync()
        st = next((s for s in self._ranks.values() if s.global_rank == global_rank), None)
        if st is None:
            return None
        rid = st.rank_id
        phase_cols = [f"{p}_ns" for p in PHASES]
        pb = self._series(("phases", rid), "steps", phase_cols, rank_is("?1"), (rid,))
        phase_series = {p: pb.series(i, 1e-6) for i, p in enumerate(PHASES)}
        mb = self._series(("mem", rid), "steps", ("peak_bytes", "reserved_bytes", "rss_bytes"), rank_is("?1"), (rid,))
        memory = {name: mb.series(i) for i, name in enumerate(("peak", "reserved", "rss"))}
        proc_rows = self.con.execute(
            f"SELECT ts, cpu_pct, rss_bytes, gpu_mem_bytes, threads FROM process WHERE {rank_is('?1')} "
            "ORDER BY ts DESC LIMIT ?2",
            (rid, self.series_points),
        ).fetchall()
        process = None
        if proc_rows:
            proc_rows.reverse()
            lt = proc_rows[-1]
            process = ProcessLatest(
                lt[1], lt[2], lt[3], lt[4], Series([r[0] for r in proc_rows], [r[1] for r in proc_rows])
            )
        scalars: dict[str, tuple[float | None, Series]] = {}
        for name in self._scalar_names(rid):
            latest = self.con.execute(
                f"SELECT value FROM scalars WHERE {rank_is('?1')} AND name=?2 ORDER BY step DESC LIMIT 1", (rid, name)
            ).fetchone()
            sb = self._series(("scalar", rid, name), "scalars", ("value",), f"{rank_is('?1')} AND name=?2", (rid, name))
            scalars[name] = (latest[0] if latest else None, sb.series(0))
        lstep = self.con.execute(f"SELECT MAX(step) FROM layers WHERE {rank_is('?1')}", (rid,)).fetchone()[0]
        layers: list[LayerRow] = []
        if lstep is not None:
            for r in self.con.execute(
                f"SELECT layer, forward_ns, backward_ns, activation_bytes FROM layers WHERE {rank_is('?1')} AND step=?2 "
                "ORDER BY rowid",
                (rid, lstep),
            ):
                layers.append(LayerRow(r[0], _ms(r[1]), _ms(r[2]), r[3]))
        models: dict[Any, ModelRow] = {}
        for r in self.con.execute(
            "SELECT model_id, name, parallelism, n_modules, param_bytes, local_shard_bytes, estimated_full_bytes "
            "FROM models WHERE rank_id=? ORDER BY rowid",
            (rid,),
        ):
            models[r[0]] = ModelRow(*r)  # latest report of each model wins
        return RankDetail(
            row=self._rank_row(st),
            phase_series=phase_series,
            memory_series=memory,
            process=process,
            scalars=scalars,
            layers_step=lstep,
            layers=layers,
            models=[models[k] for k in sorted(models, key=lambda x: (x is None, x))],
        )

    def _scalar_names(self, rank_id: int, limit: int = 32) -> list[str]:
        # Skip-scan over the scalars index (group, name, step, rank): one seek per distinct name.
        names: list[str] = []
        last = ""
        while len(names) < limit:
            row = self.con.execute(
                f"SELECT MIN(name) FROM scalars WHERE {rank_is('?1')} AND name>?2", (rank_id, last)
            ).fetchone()
            if row is None or row[0] is None:
                break
            last = row[0]
            names.append(last)
        return names


def _status(row: Sequence[Any]) -> RankStatus:
    ts, phase, since, step, done, finished = row
    return RankStatus(
        ts=float(ts or 0.0),
        phase=str(phase or "idle"),
        phase_since=float(since or 0.0),
        step=step,
        steps_done=int(done or 0),
        finished=bool(finished),
    )
