"""Step-time domain: data checks that make the engine abstain, and run-wide bounds.

A run-wide bound (INPUT_BOUND, H2D_BOUND, WAIT_HEAVY, COMPUTE_BOUND) is raised
only when most ranks show it on their own profile. Averaging across ranks
would let one slow rank push a 2-rank run over the line; counting ranks keeps
a straggler a straggler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from traceml_daemon.analysis.model import RunData, Verdict
from traceml_daemon.analysis.policy import StepPolicy
from traceml_daemon.analysis.stats import median, rank_ranges, round_ms, share
from traceml_daemon.analysis.window import RankProfile

COMPUTE_PHASES = ("forward", "backward", "optimizer")


@dataclass
class DataCheck:
    verdicts: list[Verdict] = field(default_factory=list)
    enough_steps: bool = False  # step-based domains may run
    phases_ok: bool = False  # phase shares can be trusted (every required phase seen, clocks sane)


def check_data(run: RunData, profs: list[RankProfile], policy: StepPolicy) -> DataCheck:
    out = DataCheck()
    total = max((p.n_total for p in profs), default=0)
    in_window = max((p.n_window for p in profs), default=0)
    if total == 0:
        out.verdicts.append(
            Verdict(
                "INCOMPLETE_DATA",
                "info",
                {},
                "no training steps recorded yet",
                {"reason": "no_steps", "ranks": len(run.ranks)},
                "Wrap the training step in `with agent.trace_step(model):` and let a few steps run.",
            )
        )
        return out
    if in_window == 0:
        out.verdicts.append(
            Verdict(
                "WARMUP",
                "info",
                {},
                f"all {total} steps so far are warm-up (first {policy.warmup_steps} are excluded)",
                {"reason": "warmup", "steps": total, "warmup_steps": policy.warmup_steps},
                "Wait for the run to pass warm-up; verdicts start after it.",
            )
        )
        return out
    if in_window < policy.min_steps:
        out.verdicts.append(
            Verdict(
                "INCOMPLETE_DATA",
                "info",
                {},
                f"only {in_window} steps after warm-up; at least {policy.min_steps} are needed",
                {"reason": "too_few_steps", "steps": in_window, "min_steps": policy.min_steps},
                "Wait for more steps before reading the diagnosis.",
            )
        )
        return out
    out.enough_steps = True
    out.phases_ok = True
    active = [p for p in profs if p.n_window > 0]
    for phase in policy.required_phases:
        missing = [p.global_rank for p in active if not p.captured.get(phase)]
        if missing:
            out.phases_ok = False
            everywhere = len(missing) == len(active)
            where = "any rank" if everywhere else f"ranks {rank_ranges(missing)}"
            out.verdicts.append(
                Verdict(
                    "INCOMPLETE_DATA",
                    "info",
                    {},
                    f"{phase} was never measured on {where} although steps were recorded",
                    {"reason": "phase_not_captured", "phase": phase, "ranks": rank_ranges(missing)},
                    f"Call the traced model as `model(x)` inside trace_step (not `model.forward(x)`) and pass the "
                    f"module that runs {phase} to trace_step, so its hooks fire.",
                )
            )
    bad = [p for p in active if p.bad_clock_steps >= policy.clock_bad_frac * p.n_window]
    if bad:
        out.phases_ok = False
        worst = max(bad, key=lambda p: p.bad_clock_steps / p.n_window)
        out.verdicts.append(
            Verdict(
                "INCOMPLETE_DATA",
                "info",
                {},
                f"inconsistent clocks on ranks {rank_ranges(p.global_rank for p in bad)}: phases exceed the step "
                f"or time runs backwards on {worst.bad_clock_steps} of {worst.n_window} steps of rank {worst.global_rank}",
                {
                    "reason": "inconsistent_clocks",
                    "ranks": rank_ranges(p.global_rank for p in bad),
                    "worst_rank": worst.global_rank,
                    "bad_steps": worst.bad_clock_steps,
                    "steps": worst.n_window,
                },
                "Check for NTP jumps or a mix of agent versions; phase verdicts are withheld until clocks agree.",
            )
        )
    return out


def _compute_ms(p: RankProfile) -> float | None:
    vals = [p.phases_ms.get(ph) for ph in COMPUTE_PHASES]
    if all(v is None for v in vals):
        return None
    return sum(v or 0.0 for v in vals)


def _shares(profs: list[RankProfile], part: str) -> list[float]:
    out: list[float] = []
    for p in profs:
        value = _compute_ms(p) if part == "compute" else p.phases_ms.get(part)
        s = share(value, p.step_ms)
        out.append(0.0 if s is None else s)
    return out


def bound_verdicts(profs: list[RankProfile], policy: StepPolicy) -> list[Verdict]:
    """Run-wide bounds over ranks with enough steps (call only when phases are trustworthy)."""
    ranks = [p for p in profs if p.n_window >= policy.min_steps and p.step_ms]
    if not ranks:
        return []
    need = max(1, math.ceil(policy.bound_rank_frac * len(ranks)))
    step_ms = median(p.step_ms for p in ranks)
    out: list[Verdict] = []
    specs = (
        ("INPUT_BOUND", "dataloader", policy.input_bound_frac, _INPUT_NEXT),
        ("H2D_BOUND", "h2d", policy.h2d_bound_frac, _H2D_NEXT),
        ("WAIT_HEAVY", "wait", policy.wait_heavy_frac, _WAIT_NEXT),
    )
    for name, part, limit, next_step in specs:
        shares = _shares(ranks, part)
        over = sum(1 for s in shares if s >= limit)
        if over < need:
            continue
        typical = median(shares) or 0.0
        severity = "critical" if name == "INPUT_BOUND" and typical >= policy.input_critical_frac else "warn"
        out.append(
            Verdict(
                name,
                severity,
                {},
                f"{part} takes {typical:.0%} of the step (median over ranks; {over} of {len(ranks)} ranks above {limit:.0%})",
                {
                    "phase": part,
                    "share": round(typical, 4),
                    "phase_ms": round_ms(median(p.phases_ms.get(part) for p in ranks)),
                    "step_ms": round_ms(step_ms),
                    "ranks_over": over,
                    "ranks": len(ranks),
                    "threshold": limit,
                },
                next_step,
            )
        )
    if not out:
        shares = _shares(ranks, "compute")
        over = sum(1 for s in shares if s >= policy.compute_bound_frac)
        if over >= need:
            typical = median(shares) or 0.0
            out.append(
                Verdict(
                    "COMPUTE_BOUND",
                    "info",
                    {},
                    f"healthy: forward+backward+optimizer take {typical:.0%} of the step; no input, copy or wait bottleneck",
                    {"share": round(typical, 4), "step_ms": round_ms(step_ms), "ranks": len(ranks)},
                    "Speed up the model itself: mixed precision (bf16), torch.compile, fused optimizers, larger batch.",
                )
            )
    return out


_INPUT_NEXT = (
    "Raise DataLoader num_workers, set pin_memory=True and persistent_workers=True, raise prefetch_factor, "
    "and move decoding/augmentation off the training process."
)
_H2D_NEXT = (
    "Use pinned host memory (pin_memory=True) with .to(device, non_blocking=True), move less data per step, "
    "and check PCIe/NUMA placement (nvidia-smi topo -m)."
)
_WAIT_NEXT = (
    "Time goes to collectives without a slow rank to blame: check interconnect bandwidth (NCCL_DEBUG=INFO), "
    "tune DDP bucket_cap_mb, overlap communication with backward, or raise the per-rank batch."
)
