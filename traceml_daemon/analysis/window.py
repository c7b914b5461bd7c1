"""Per-rank profile over the analysis window: the one place warm-up is cut.

Every step-based domain (steps, stragglers, nodes, compare) reads these
profiles, so they all agree on which steps count. Warm-up is cut by step
number from the run's first step, so a loader that hands over only the tail
of a long run loses at most ``warmup_steps`` steps of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from traceml_daemon.analysis.model import PHASES, RankData, RunData
from traceml_daemon.analysis.stats import NS_PER_MS, median

T = TypeVar("T")


@dataclass
class RankProfile:
    global_rank: int
    node_rank: int | None
    hostname: str | None
    n_total: int  # steps the loader gave
    n_window: int  # steps after warm-up and windowing
    step_ms: float | None = None
    phases_ms: dict[str, float | None] = field(default_factory=dict)
    busy_ms: float | None = None  # step minus wait: the rank's own work (what DDP sync hides)
    captured: dict[str, bool] = field(default_factory=dict)  # phase non-zero on some window step
    bad_clock_steps: int = 0  # phases summing past the step, negative durations, time going back


def _at(values: Sequence[T | None], i: int) -> T | None:
    return values[i] if i < len(values) else None


def run_first_step(run: RunData) -> int | None:
    firsts = [r.steps[0] for r in run.ranks if r.steps]
    return min(firsts) if firsts else None


def window_indices(rank: RankData, cut: int | None, window: int | None) -> list[int]:
    """Indices of ``rank.steps`` past warm-up (step >= cut), the last ``window`` of them."""
    idx = [i for i, s in enumerate(rank.steps) if cut is None or s >= cut]
    if window is not None and len(idx) > window:
        idx = idx[-window:]
    return idx


def profile_rank(rank: RankData, cut: int | None, window: int | None, clock_slack: float) -> RankProfile:
    idx = window_indices(rank, cut, window)
    prof = RankProfile(rank.global_rank, rank.node_rank, rank.hostname, len(rank.steps), len(idx))
    step = [_at(rank.step_ns, i) for i in idx]
    phases = {p: [_at(rank.phases_ns.get(p, ()), i) for i in idx] for p in PHASES}
    prof.step_ms = _ms(median(step))
    prof.phases_ms = {p: _ms(median(v)) for p, v in phases.items()}
    prof.captured = {p: any(v) for p, v in phases.items()}
    busy: list[float] = []
    bad = 0
    last_ts: float | None = None
    for k, i in enumerate(idx):
        s = step[k]
        parts = [phases[p][k] for p in PHASES]
        measured = [v for v in parts if v is not None]
        ts = _at(rank.step_ts, i)
        if (
            (s is not None and (s <= 0 or sum(measured) > s * (1.0 + clock_slack)))
            or any(v < 0 for v in measured)
            or (ts is not None and last_ts is not None and ts < last_ts)
        ):
            bad += 1
        if ts is not None:
            last_ts = ts
        if s is not None:
            busy.append(s - (phases["wait"][k] or 0))
    prof.busy_ms = _ms(median(busy))
    prof.bad_clock_steps = bad
    return prof


def profiles(run: RunData, warmup_steps: int, window: int | None, clock_slack: float) -> list[RankProfile]:
    """One profile per rank, in ``run.ranks`` order. ``window=None`` keeps every post-warm-up step."""
    first = run_first_step(run)
    cut = None if first is None else first + warmup_steps
    return [profile_rank(r, cut, window, clock_slack) for r in run.ranks]


def _ms(value: float | None) -> float | None:
    return None if value is None else value / NS_PER_MS
