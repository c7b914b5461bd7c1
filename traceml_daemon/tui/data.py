"""Read-only data access for the TUI (stdlib sqlite3 only, no textual).

Opens the database with ``file:PATH?mode=ro`` so it never blocks the daemon's
writer (WAL) and works the same on a finished run. Every query is bounded:

* per-rank windows of the most recent ``window`` steps are loaded once through
  the ``(rank_id, step)`` index and then extended incrementally by ``rowid``
  (rows are only ever appended, so ``rowid > last`` is exactly "what is new");
* series are aggregated in SQL (``GROUP BY step / bucket``) into power-of-two
  buckets that are cached and merged pairwise, so a refresh only aggregates the
  steps written since the previous one and never returns more than W points;
* process/system/gpu series read the last W samples through their index.

Everything returned is a plain dataclass; ``None`` always means "not measured".
"""

from __future__ import annotations

import math
import sqlite3
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from traceml_daemon.analysis.model import PHASES, RankData, RankStatus, RunData, Verdict

WINDOW = 32  # recent steps per rank kept in memory for medians and diagnosis
SERIES_POINTS = 120  # default W for downsampled series
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
    frames_received: int | None = None
    rows_stored: int | None = None
    duplicates_discarded: int | None = None
    dropped: int = 0
    spooled: int = 0
    counters: dict[str, dict[str, int]] = field(default_factory=dict)  # source -> counter -> value


@dataclass(frozen=True)
class JobHeader:
    session: str
    attempt: int
    nnodes: int
    world_size: int
    parallelism: str
    latest_step: int | None
    steps_per_s: float | None
    uptime_s: float | None
    live: bool
    delivery: Delivery


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
    median_ms: float | None  # median of the node's rank medians
    worst_rank: int | None
    worst_ms: float | None
    skew_pct: float | None  # (worst - node median) / node median


@dataclass(frozen=True)
class Overview:
    header: JobHeader
    ranks: list[RankRow]
    nodes: list[NodeRow]
    step_series: Series  # run step time (ms), the lowest global rank
    series_rank: int | None
    verdicts: list[Verdict]
    verdicts_available: bool  # False until the analysis engine exists


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
    step_series: dict[int, Series]  # global rank -> step ms
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


def _median_col(col: Sequence[float | int | None]) -> float | None:
    xs = sorted([v for v in col if v is not None])
    n = len(xs)
    if not n:
        return None
    return float(xs[n // 2]) if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2.0


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
            lo, hi = con.execute(
                f"SELECT MIN(step), MAX(step) FROM {self.table} WHERE {self.where}", self.params
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
    medians: tuple[float | None, dict[str, float | None]] | None = None  # cache, reset on new rows


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
        diagnose_every: int = 5,
    ) -> None:
        import os

        if not os.path.exists(path):
            raise DatabaseMissing(f"no TraceML database at {path!r} (start `traceml-daemon serve --db {path}`)")
        self.path = path
        # check_same_thread=False: the app reads from thread workers (one at a time).
        self.con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
        self.window = window
        self.series_points = series_points
        self.clock = clock if clock is not None else time.time
        self.diagnose_every = max(1, diagnose_every)
        self._ranks: dict[int, _RankState] = {}
        self._session: tuple[str, int] | None = None
        self._steps_rowid = 0
        self._status_rowid = 0
        self._buckets: dict[tuple[Any, ...], _Buckets] = {}
        self._refreshes = 0
        self._verdicts: list[Verdict] = []
        self._verdicts_ok = False
        self._parallelism = "single"
        self._last_seen: float | None = None

    def close(self) -> None:
        self.con.close()

    # ---- identity and incremental windows

    def _has_table(self, name: str) -> bool:
        row = self.con.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?", (name,)).fetchone()
        return row is not None

    def _load_ranks(self) -> None:
        if not self._has_table("ranks"):
            return
        # The current run is the session/attempt of the most recently seen sender.
        row = self.con.execute(
            "SELECT session, attempt FROM ranks ORDER BY last_seen DESC, attempt DESC LIMIT 1"
        ).fetchone()
        if row is None:
            return
        session = (str(row[0]), int(row[1] or 0))
        if session != self._session:  # a restart: start over with the new attempt
            self._session = session
            self._ranks = {}
            self._buckets = {}
            self._steps_rowid = 0
            self._status_rowid = 0
        new: list[_RankState] = []
        # Only senders not seen yet are read row by row; liveness needs just the newest last_seen.
        known = max(self._ranks, default=0)
        for r in self.con.execute(
            "SELECT rank_id, global_rank, local_rank, node_rank, hostname, first_seen, last_seen, parallelism "
            "FROM ranks WHERE session=? AND attempt=? AND rank_id>? ORDER BY global_rank",
            (*session, known),
        ):
            if r[7]:
                self._parallelism = str(r[7])
            st = _RankState(r[0], int(r[1] if r[1] is not None else r[0]), r[2], int(r[3] or 0), r[4], r[5], r[6])
            self._ranks[r[0]] = st
            new.append(st)
        self._last_seen = self.con.execute(
            "SELECT MAX(last_seen) FROM ranks WHERE session=? AND attempt=?", session
        ).fetchone()[0]
        if new:
            self._initial_windows(new)

    def _initial_windows(self, states: list[_RankState]) -> None:
        cols = ", ".join(_STEP_COLS)
        for st in states:
            lo, hi = self.con.execute(
                "SELECT MIN(step), MAX(step) FROM steps WHERE rank_id=?", (st.rank_id,)
            ).fetchone()
            st.first_step, st.last_step = lo, hi
            if hi is None:
                continue
            for row in self.con.execute(
                f"SELECT {cols} FROM steps WHERE rank_id=? AND step>? ORDER BY step", (st.rank_id, hi - self.window)
            ):
                st.window[row[0]] = row
            srow = self.con.execute(
                "SELECT ts, phase, phase_since, step, steps_done, finished FROM status WHERE rank_id=? "
                "ORDER BY ts DESC LIMIT 1",
                (st.rank_id,),
            ).fetchone()
            if srow is not None:
                st.status = _status(srow)
        if not self._steps_rowid:
            self._steps_rowid = self.con.execute("SELECT COALESCE(MAX(rowid), 0) FROM steps").fetchone()[0]
            self._status_rowid = self.con.execute("SELECT COALESCE(MAX(rowid), 0) FROM status").fetchone()[0]

    def _tail(self) -> None:
        cols = ", ".join(_STEP_COLS)
        touched: set[int] = set()
        last = self._steps_rowid
        for row in self.con.execute(f"SELECT rowid, rank_id, {cols} FROM steps WHERE rowid>?", (self._steps_rowid,)):
            last = row[0]
            st = self._ranks.get(row[1])
            if st is None:
                continue
            data = row[2:]
            step = data[0]
            st.window[step] = data
            st.last_step = step if st.last_step is None else max(st.last_step, step)
            st.first_step = step if st.first_step is None else min(st.first_step, step)
            touched.add(row[1])
        self._steps_rowid = last
        for rid in touched:
            st = self._ranks[rid]
            st.medians = None
            if len(st.window) > self.window:
                for step in sorted(st.window)[: len(st.window) - self.window]:
                    del st.window[step]
        last = self._status_rowid
        for row in self.con.execute(
            "SELECT rowid, rank_id, ts, phase, phase_since, step, steps_done, finished FROM status WHERE rowid>?",
            (self._status_rowid,),
        ):
            last = row[0]
            st = self._ranks.get(row[1])
            if st is not None and (st.status is None or row[2] >= st.status.ts):
                st.status = _status(row[2:])
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
        if st.medians is None:
            # Transpose once; list comprehensions here are the hot loop at 4096 ranks.
            cols = list(zip(*st.window.values(), strict=True))
            step_ms = _ms(_median_col(cols[2]))
            phases = {p: _ms(_median_col(cols[3 + i])) for i, p in enumerate(PHASES)}
            st.medians = (step_ms, phases)
        latest = st.window[st.last_step] if st.last_step in st.window else None
        steps = 0 if st.last_step is None or st.first_step is None else st.last_step - st.first_step + 1
        return RankRow(
            rank_id=st.rank_id,
            global_rank=st.global_rank,
            local_rank=st.local_rank,
            node_rank=st.node_rank,
            hostname=st.hostname,
            steps=steps,
            last_step=st.last_step,
            step_ms=st.medians[0],
            phase_ms=dict(st.medians[1]),
            rss_bytes=latest[12] if latest else None,
            peak_bytes=latest[10] if latest else None,
            status_phase=st.status.phase if st.status else None,
        )

    def _delivery(self) -> Delivery:
        counters: dict[str, dict[str, int]] = {}
        if self._has_table("delivery"):
            for source, counter, value in self.con.execute("SELECT source, counter, value FROM delivery"):
                counters.setdefault(str(source), {})[str(counter)] = int(value)

        def total(name: str) -> int | None:
            vals = [c[name] for c in counters.values() if name in c]
            return sum(vals) if vals else None

        dropped = sum(v for c in counters.values() for k, v in c.items() if "drop" in k)
        spooled = sum(v for c in counters.values() for k, v in c.items() if "spool" in k)
        return Delivery(
            frames_received=total("frames_received"),
            rows_stored=total("rows_stored"),
            duplicates_discarded=total("duplicates_discarded"),
            dropped=dropped,
            spooled=spooled,
            counters=counters,
        )

    def _header(self, rows: list[RankRow]) -> JobHeader:
        states = list(self._ranks.values())
        now = self.clock()
        first = min((s.first_seen for s in states if s.first_seen is not None), default=None)
        last = self._last_seen
        finished = bool(states) and all(s.status is not None and s.status.finished for s in states)
        live = not finished and last is not None and now - last < 30.0
        uptime = None if first is None else ((now if live else (last or first)) - first)
        latest = max((s.last_step for s in states if s.last_step is not None), default=None)
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
            delivery=self._delivery(),
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
    def nodes_from(rows: list[RankRow]) -> list[NodeRow]:
        by_node: dict[int, list[RankRow]] = {}
        for r in rows:
            by_node.setdefault(r.node_rank, []).append(r)
        out: list[NodeRow] = []
        for node, rs in by_node.items():
            med = median(r.step_ms for r in rs)
            measured = [r for r in rs if r.step_ms is not None]
            worst = max(measured, key=lambda r: (r.step_ms, -r.global_rank)) if measured else None
            skew = None
            if worst is not None and med:
                skew = (worst.step_ms - med) / med * 100.0  # type: ignore[operator]
            out.append(
                NodeRow(
                    node_rank=node,
                    hostname=rs[0].hostname,
                    ranks=len(rs),
                    median_ms=med,
                    worst_rank=worst.global_rank if worst else None,
                    worst_ms=worst.step_ms if worst else None,
                    skew_pct=skew,
                )
            )
        # Worst first: slowest node median, then largest skew; unmeasured last.
        out.sort(key=lambda n: (n.median_ms is None, -(n.median_ms or 0.0), -(n.skew_pct or 0.0), n.node_rank))
        return out

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
        return self._series(("steps", rank_id), "steps", ("step_ns",), "rank_id=?", (rank_id,)).series(0, 1e-6)

    # ---- diagnosis

    def run_data(self) -> RunData:
        """A RunData over the in-memory recent windows (bounded: ``window`` steps per rank)."""
        ranks: list[RankData] = []
        for st in sorted(self._ranks.values(), key=lambda s: s.global_rank):
            rows = [st.window[k] for k in sorted(st.window)]
            ranks.append(
                RankData(
                    global_rank=st.global_rank,
                    local_rank=st.local_rank,
                    node_rank=st.node_rank,
                    hostname=st.hostname,
                    steps=[r[0] for r in rows],
                    step_ns=[r[2] for r in rows],
                    phases_ns={p: [r[3 + i] for r in rows] for i, p in enumerate(PHASES)},
                    comm_ns=[r[9] for r in rows],
                    peak_bytes=[r[10] for r in rows],
                    reserved_bytes=[r[11] for r in rows],
                    rss_bytes=[r[12] for r in rows],
                    step_ts=[r[1] for r in rows],
                    status=st.status,
                )
            )
        states = list(self._ranks.values())
        live = bool(states) and not all(s.status is not None and s.status.finished for s in states)
        return RunData(ranks=ranks, parallelism=self._parallelism, now=self.clock() if live else None, live=live)

    def _diagnose(self) -> None:
        try:
            from traceml_daemon.analysis.engine import diagnose  # lands separately; optional
        except ImportError:
            self._verdicts_ok = False
            return
        try:
            verdicts = list(diagnose(self.run_data()))
        except Exception as exc:  # a diagnosis bug must not take the UI down
            verdicts = [Verdict("DIAGNOSIS_ERROR", "warn", {}, f"analysis failed: {exc.__class__.__name__}: {exc}")]
        order = {"critical": 0, "warn": 1, "info": 2}
        verdicts.sort(key=lambda v: order.get(v.severity, 3))
        self._verdicts = verdicts
        self._verdicts_ok = True

    # ---- public snapshots

    def overview(self) -> Overview:
        self._sync()
        rows = [self._rank_row(st) for st in sorted(self._ranks.values(), key=lambda s: s.global_rank)]
        series_rank = rows[0] if rows else None
        series = self.step_series(series_rank.rank_id) if series_rank else Series()
        # Diagnosis is the costly part at scale: run it on the first refresh and every Nth after.
        if self._refreshes % self.diagnose_every == 0:
            self._diagnose()
        self._refreshes += 1
        return Overview(
            header=self._header(rows),
            ranks=rows,
            nodes=self.nodes_from(rows),
            step_series=series,
            series_rank=series_rank.global_rank if series_rank else None,
            verdicts=list(self._verdicts),
            verdicts_available=self._verdicts_ok,
        )

    def node_detail(self, node_rank: int) -> NodeDetail | None:
        self._sync()
        states = sorted((s for s in self._ranks.values() if s.node_rank == node_rank), key=lambda s: s.global_rank)
        if not states:
            return None
        rows = [self._rank_row(s) for s in states]
        sparks = {s.global_rank: self.step_series(s.rank_id) for s in states[:64]}
        system: SystemLatest | None = None
        gpus: list[GpuLatest] = []
        for s in states:  # the host sampler runs on the node's local rank 0; find whoever sent rows
            sys_rows = self.con.execute(
                "SELECT ts, cpu_pct, mem_used_bytes, mem_total_bytes, net_rx_bps, net_tx_bps FROM system "
                "WHERE rank_id=? ORDER BY ts DESC LIMIT ?",
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
                    "WHERE rank_id=? ORDER BY ts DESC LIMIT 256",
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
        pb = self._series(("phases", rid), "steps", phase_cols, "rank_id=?", (rid,))
        phase_series = {p: pb.series(i, 1e-6) for i, p in enumerate(PHASES)}
        mb = self._series(("mem", rid), "steps", ("peak_bytes", "reserved_bytes", "rss_bytes"), "rank_id=?", (rid,))
        memory = {name: mb.series(i) for i, name in enumerate(("peak", "reserved", "rss"))}
        proc_rows = self.con.execute(
            "SELECT ts, cpu_pct, rss_bytes, gpu_mem_bytes, threads FROM process WHERE rank_id=? ORDER BY ts DESC LIMIT ?",
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
                "SELECT value FROM scalars WHERE rank_id=? AND name=? ORDER BY step DESC LIMIT 1", (rid, name)
            ).fetchone()
            sb = self._series(("scalar", rid, name), "scalars", ("value",), "rank_id=? AND name=?", (rid, name))
            scalars[name] = (latest[0] if latest else None, sb.series(0))
        lstep = self.con.execute("SELECT MAX(step) FROM layers WHERE rank_id=?", (rid,)).fetchone()[0]
        layers: list[LayerRow] = []
        if lstep is not None:
            for r in self.con.execute(
                "SELECT layer, forward_ns, backward_ns, activation_bytes FROM layers WHERE rank_id=? AND step=? "
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
        # Skip-scan over the (rank_id, name, step) index: one seek per distinct name.
        names: list[str] = []
        last = ""
        while len(names) < limit:
            row = self.con.execute(
                "SELECT MIN(name) FROM scalars WHERE rank_id=? AND name>?", (rank_id, last)
            ).fetchone()
            if row is None or row[0] is None:
                break
            last = row[0]
            names.append(last)
        return names

    def find(self, query: str) -> tuple[str, int] | None:
        """Parse a jump query: "r12"/"12" -> ("rank", 12), "n3" -> ("node", 3); None if unknown."""
        q = query.strip().lower()
        kind = "rank"
        if q[:1] in ("r", "n"):
            kind = "rank" if q[0] == "r" else "node"
            q = q[1:].strip()
        if not q.isdigit():
            return None
        n = int(q)
        if kind == "rank" and any(s.global_rank == n for s in self._ranks.values()):
            return ("rank", n)
        if kind == "node" and any(s.node_rank == n for s in self._ranks.values()):
            return ("node", n)
        return None


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
