"""Per-rank profile over the analysis window: the one place warm-up is cut.

Every step-based domain (steps, stragglers, nodes, compare) reads these
profiles, so they all agree on which steps count. Warm-up is cut by step
number from the run's first step, so a loader that hands over only the tail
of a long run loses at most ``warmup_steps`` steps of it.
"""

from __future__ import annotations

from bisect import bisect_left
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
    busy_ms: float | None = None  # the rank's own work: step minus wait under DDP (what sync hides), else step
    # Phases less the collective wait measured inside them (FSDP2), what a straggler is named
    # by; the same as ``phases_ms`` where nothing was measured inside a phase.
    work_ms: dict[str, float | None] = field(default_factory=dict)
    # FSDP2's measured collective wait per step (medians): forward, backward, replicate
    # (HSDP's all-reduce, inside backward); empty where not measured.
    comm_ms: dict[str, float | None] = field(default_factory=dict)
    captured: dict[str, bool] = field(default_factory=dict)  # phase non-zero on some window step
    bad_clock_steps: int = 0  # phases summing past the step, negative durations, time going back


def _slice(values: Sequence[T | None], lo: int, hi: int) -> list[T | None]:
    """values[lo:hi], padded with None where the loader gave a shorter list."""
    out = list(values[lo:hi])
    if len(out) < hi - lo:
        out.extend([None] * (hi - lo - len(out)))
    return out


def run_first_step(run: RunData) -> int | None:
    firsts = [r.steps[0] for r in run.ranks if r.steps]
    return min(firsts) if firsts else None


def window_bounds(rank: RankData, cut: int | None, window: int | None) -> tuple[int, int]:
    """[lo, hi) of ``rank.steps`` past warm-up (step >= cut), the last ``window`` of them.

    Steps are oldest first, so the window is one contiguous slice: O(log n) to find."""
    hi = len(rank.steps)
    lo = 0 if cut is None else bisect_left(rank.steps, cut)
    if window is not None:
        lo = max(lo, hi - window)
    return lo, hi


def window_indices(rank: RankData, cut: int | None, window: int | None) -> range:
    lo, hi = window_bounds(rank, cut, window)
    return range(lo, hi)


def profile_rank(
    rank: RankData, cut: int | None, window: int | None, clock_slack: float, measured_wait: bool = True
) -> RankProfile:
    lo, hi = window_bounds(rank, cut, window)
    prof = RankProfile(rank.global_rank, rank.node_rank, rank.hostname, len(rank.steps), hi - lo)
    step = _slice(rank.step_ns, lo, hi)
    phases = {p: _slice(rank.phases_ns.get(p, ()), lo, hi) for p in PHASES}
    prof.step_ms = _ms(median(step))
    prof.phases_ms = {p: _ms(median(v)) for p, v in phases.items()}
    prof.captured = {p: any(v) for p, v in phases.items()}
    wait = phases["wait"]
    if measured_wait:
        # A step without its wait (a GPU step timed on the host only) says nothing of busy time.
        prof.busy_ms = _ms(median(s - w for s, w in zip(step, wait, strict=True) if s is not None and w is not None))
    else:
        prof.busy_ms = prof.step_ms
    prof.work_ms = dict(prof.phases_ms)
    _fsdp2_wait(prof, rank, lo, hi, step, phases)
    prof.bad_clock_steps = _bad_clock_steps(step, list(phases.values()), _slice(rank.step_ts, lo, hi), clock_slack)
    return prof


def _fsdp2_wait(
    prof: RankProfile, rank: RankData, lo: int, hi: int, step: list[int | None], phases: dict[str, list[int | None]]
) -> None:
    """Under FSDP2 with measured collectives: busy time and phase work net of the wait inside them.

    The waiting happens inside forward (all-gather) and backward (all-gather, reduce-scatter,
    HSDP all-reduce), so a rank waiting for a slow peer has as long a phase as the peer;
    without the measured wait the victims would look as slow as the culprit."""
    fwd = _slice(rank.fwd_comm_ns, lo, hi)
    bwd = _slice(rank.bwd_comm_ns, lo, hi)
    if all(v is None for v in fwd) and all(v is None for v in bwd):
        return
    prof.comm_ms = {
        "forward": _ms(median(fwd)),
        "backward": _ms(median(bwd)),
        "replicate": _ms(median(_slice(rank.replicate_comm_ns, lo, hi))),
    }
    prof.busy_ms = _ms(median(s - (f or 0) - (b or 0) for s, f, b in zip(step, fwd, bwd, strict=True) if s is not None))
    for phase, comm in (("forward", fwd), ("backward", bwd)):
        prof.work_ms[phase] = _ms(median(max(0, p - (c or 0)) for p, c in zip(phases[phase], comm, strict=True)
                                         if p is not None))


def _bad_clock_steps(
    step: list[int | None], phases: list[list[int | None]], ts: list[float | None], slack: float
) -> int:
    """Steps whose phases sum past the step, hold a negative duration, or end before the previous one."""
    bad = 0
    last: float | None = None
    for s, t, *parts in zip(step, ts, *phases, strict=True):
        measured = [v for v in parts if v is not None]
        if (
            (s is not None and (s <= 0 or sum(measured) > s * (1.0 + slack)))
            or (measured and min(measured) < 0)
            or (t is not None and last is not None and t < last)
        ):
            bad += 1
        if t is not None:
            last = t
    return bad


def _comm_measured(run: RunData) -> bool:
    return any(v is not None for r in run.ranks for v in r.comm_ns[-1:])


def collective_coupled(run: RunData) -> bool:
    """The agent saw the ranks step together: a DDP or FSDP2 model, or a measured all-reduce.

    Then a rank's extra time anywhere in its step holds the others back in a collective;
    in a "single" run nothing says the ranks wait on one another at all."""
    return run.parallelism in ("ddp", "fsdp2") or _comm_measured(run)


def profiles(run: RunData, warmup_steps: int, window: int | None, clock_slack: float) -> list[RankProfile]:
    """One profile per rank, in ``run.ranks`` order. ``window=None`` keeps every post-warm-up step."""
    first = run_first_step(run)
    cut = None if first is None else first + warmup_steps
    # Only DDP measures wait as time blocked on peers; elsewhere it is the unmeasured
    # residual of the step, which is the rank's own (slow) work and must count as busy.
    # A measured all-reduce (comm_ns) marks DDP too, should the run be labelled otherwise.
    measured_wait = run.parallelism == "ddp" or _comm_measured(run)
    return [profile_rank(r, cut, window, clock_slack, measured_wait) for r in run.ranks]


def _ms(value: float | None) -> float | None:
    return None if value is None else value / NS_PER_MS
