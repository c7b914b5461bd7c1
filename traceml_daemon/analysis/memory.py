"""Memory domain: pressure against capacity, imbalance across ranks, creep over time.

The series is the device peak (``peak_bytes``) where any rank measured it and
the process RSS otherwise, so CPU runs get the same verdicts. Creep looks at
the whole post-warm-up series (a leak shows over thousands of steps, not in
the last window) cut in a few segments: every segment's median must rise, so
a one-time allocator step or a noisy spike is not a creep.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from traceml_daemon.analysis.model import RankData, RunData, Verdict
from traceml_daemon.analysis.policy import MemoryPolicy
from traceml_daemon.analysis.stats import median, rank_ranges, segment_medians
from traceml_daemon.analysis.window import run_first_step, window_indices

MiB = 2**20


def memory_metric(run: RunData) -> str:
    """'peak_bytes' when any rank measured device memory, else 'rss_bytes'."""
    return "peak_bytes" if any(v is not None for r in run.ranks for v in r.peak_bytes) else "rss_bytes"


def _series(rank: RankData, metric: str, idx: Sequence[int]) -> list[int]:
    values: list[int | None] = getattr(rank, metric)
    return [v for v in (values[i] for i in idx if i < len(values)) if v is not None]


def memory_verdicts(run: RunData, policy: MemoryPolicy, warmup_steps: int, window: int) -> list[Verdict]:
    metric = memory_metric(run)
    first = run_first_step(run)
    cut = None if first is None else first + warmup_steps
    out: list[Verdict] = []
    pressure: list[tuple[int, float, int, int]] = []  # rank, fraction, peak, capacity
    typical: list[tuple[int, float]] = []  # rank, median bytes in window
    creep: dict[bool, list[Creep]] = {True: [], False: []}  # confirmed -> hits
    for rank in run.ranks:
        whole = window_indices(rank, cut, None)
        recent = whole[-window:]
        values = _series(rank, metric, recent)
        if values:
            typical.append((rank.global_rank, median(values) or 0.0))
            if metric == "peak_bytes" and rank.device_total_bytes:
                top = max(values)
                pressure.append((rank.global_rank, top / rank.device_total_bytes, top, rank.device_total_bytes))
        capacity = rank.device_total_bytes if metric == "peak_bytes" else None
        found = _creep(rank.global_rank, _series(rank, metric, whole), policy, capacity)
        if found is not None:
            creep[found.confirmed].append(found)
    out.extend(_pressure_verdicts(pressure, policy))
    out.extend(_imbalance_verdicts(typical, policy, metric))
    for hits in creep.values():
        if hits:
            out.append(_creep_verdict(hits, metric))
    return out


def _pressure_verdicts(pressure: list[tuple[int, float, int, int]], policy: MemoryPolicy) -> list[Verdict]:
    hot = [p for p in pressure if p[1] >= policy.high_pressure_frac]
    if not hot:
        return []
    worst = max(hot, key=lambda p: p[1])
    severity = "critical" if worst[1] >= policy.critical_pressure_frac else "warn"
    scope = {"global_rank": worst[0]} if len(hot) == 1 else {}
    who = f"rank {worst[0]}" if len(hot) == 1 else f"ranks {rank_ranges(p[0] for p in hot)}"
    return [
        Verdict(
            "HIGH_PRESSURE",
            severity,
            scope,
            f"{who} peak at {worst[1]:.0%} of device memory ({worst[2] / MiB:.0f} of {worst[3] / MiB:.0f} MiB on rank {worst[0]})",
            {
                "ranks": rank_ranges(p[0] for p in hot),
                "worst_rank": worst[0],
                "fraction": round(worst[1], 4),
                "peak_bytes": worst[2],
                "capacity_bytes": worst[3],
            },
            "One allocation spike away from OOM: lower the micro-batch, use activation checkpointing, bf16, "
            "or set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True against fragmentation.",
        )
    ]


def _imbalance_verdicts(typical: list[tuple[int, float]], policy: MemoryPolicy, metric: str) -> list[Verdict]:
    if len(typical) < 2:
        return []
    hi = max(typical, key=lambda t: t[1])
    lo = min(typical, key=lambda t: t[1])
    diff = hi[1] - lo[1]
    if hi[1] <= 0 or diff < policy.imbalance_min_bytes or diff / hi[1] < policy.imbalance_frac:
        return []
    return [
        Verdict(
            "IMBALANCE",
            "warn",
            {},
            f"rank {hi[0]} uses {hi[1] / MiB:.0f} MiB ({metric}) vs {lo[1] / MiB:.0f} MiB on rank {lo[0]} ({diff / hi[1]:.0%} less)",
            {
                "metric": metric,
                "max_rank": hi[0],
                "max_bytes": int(hi[1]),
                "min_rank": lo[0],
                "min_bytes": int(lo[1]),
                "fraction": round(diff / hi[1], 4),
            },
            "Ranks hold different amounts: check uneven batch or sequence lengths, rank-0-only work (eval, logging, "
            "checkpoint gathering) and, for FSDP2, uneven shard sizes.",
        )
    ]


@dataclass
class Creep:
    rank: int
    confirmed: bool
    steps: int
    start_bytes: float
    end_bytes: float
    per_step: float
    steps_to_full: int | None

    def evidence(self) -> dict[str, object]:
        return {
            "steps": self.steps,
            "start_bytes": int(self.start_bytes),
            "end_bytes": int(self.end_bytes),
            "growth_bytes": int(self.end_bytes - self.start_bytes),
            "bytes_per_step": round(self.per_step, 1),
            "steps_to_full": self.steps_to_full,
        }


def _creep(rank: int, values: list[int], policy: MemoryPolicy, capacity: int | None) -> Creep | None:
    parts = policy.creep_segments
    if len(values) < 2 * parts:
        return None
    meds = segment_medians(values, parts)
    if len(meds) != parts or any(b <= a for a, b in zip(meds, meds[1:], strict=False)):
        return None
    growth = meds[-1] - meds[0]
    if growth < max(policy.creep_min_bytes, policy.creep_min_frac * meds[0]):
        return None
    # First and last segment medians sit (parts-1)/parts of the series apart.
    per_step = growth / (len(values) * (parts - 1) / parts)
    to_full = int(max(0.0, capacity - values[-1]) / per_step) if capacity and per_step > 0 else None
    filling = to_full is not None and to_full <= policy.creep_confirm_full_steps
    confirmed = len(values) >= policy.creep_confirm_steps and (growth >= policy.creep_confirm_frac * meds[0] or filling)
    return Creep(rank, confirmed, len(values), meds[0], meds[-1], per_step, to_full)


def _creep_verdict(hits: list[Creep], metric: str) -> Verdict:
    worst = max(hits, key=lambda c: c.per_step)
    name = "CREEP_CONFIRMED" if worst.confirmed else "CREEP_EARLY"
    evidence = worst.evidence()
    evidence.update({"metric": metric, "ranks": rank_ranges(c.rank for c in hits), "worst_rank": worst.rank})
    scope = {"global_rank": worst.rank} if len(hits) == 1 else {}
    who = f"rank {worst.rank}" if len(hits) == 1 else f"ranks {rank_ranges(c.rank for c in hits)}"
    what = "device peak memory" if metric == "peak_bytes" else "process RSS"
    tail = f"; full in ~{worst.steps_to_full} steps" if worst.steps_to_full is not None else ""
    sure = "keeps growing" if worst.confirmed else "is starting to grow"
    return Verdict(
        name,
        "warn" if worst.confirmed else "info",
        scope,
        f"{what} of {who} {sure}: {worst.start_bytes / MiB:.0f} -> {worst.end_bytes / MiB:.0f} MiB "
        f"over {worst.steps} steps (+{worst.per_step / 1024:.1f} KiB/step){tail}",
        evidence,
        "Look for tensors kept across steps: accumulating the loss without .item()/.detach(), lists of outputs, "
        "caches keyed by step, or a growing autograd graph; compare torch.cuda.memory_snapshot() at two steps.",
    )
