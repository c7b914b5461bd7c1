"""What the TUI's data side hands the screens: plain frozen dataclasses, built by
``tui.data`` (refreshes) and ``tui.analyzer`` (findings), and the pure helpers
that combine them. No database access, no Textual.

``None`` always means "not measured", never zero.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from traceml_daemon.analysis.model import Verdict
from traceml_daemon.store.read.series import Series

__all__ = [
    "Analysis", "DatabaseMissing", "Delivery", "GpuLatest", "JobHeader", "LayerRow", "ModelRow", "NodeDetail",
    "NodeRow", "Overview", "ProcessLatest", "RankDetail", "RankRow", "Series", "Snapshot", "SystemLatest",
    "downsample", "median", "nodes_from", "with_analysis",
]


class DatabaseMissing(FileNotFoundError):
    """The database path does not exist (raised with the path in the message)."""


@dataclass(frozen=True)
class Delivery:
    """Delivery counters as the summary reports them (``store.read.delivery.delivery_counters``).

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
    new_runs: list[str] = field(default_factory=list)  # sessions started since the view opened, not shown


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
    # FSDP2 shard view (store.read.fsdp2.recent_view): None when the rank traced no FSDP2 model
    fsdp2: dict[str, Any] | None = None
    # torch.profiler trace files the rank wrote: (first step, steps, path)
    profiles: list[tuple[int | None, int | None, str]] = field(default_factory=list)



def median(values: Iterable[float | int | None]) -> float | None:
    """Median of the measured values (None ignored); None when nothing measured."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    n = len(xs)
    mid = n // 2
    return float(xs[mid]) if n % 2 else (xs[mid - 1] + xs[mid]) / 2.0


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


@dataclass(frozen=True)
class Snapshot:
    """Everything one refresh read; the detail fields only for the screen that asked."""

    overview: Overview
    node: NodeDetail | None = None
    rank: RankDetail | None = None
