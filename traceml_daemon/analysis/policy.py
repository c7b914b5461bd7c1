"""Every threshold the analysis engine uses, one frozen dataclass per domain.

The live TUI, the final summary and compare all pass the same ``Policy`` so a
verdict means the same thing everywhere; change a number here, not in a domain.
Fractions are of the reference step time unless said otherwise.

A site overrides any of them without editing code: ``--policy FILE`` (serve,
summary, tui) reads a TOML file whose sections are the ``Policy`` fields below
and whose keys are their fields (``analysis/policy_file.py``). Every verdict,
its rule and the fields it reads are in ``docs/diagnosis.md``; a field added
here is settable from a file at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepPolicy:
    warmup_steps: int = 5  # first steps of the run excluded (compile, cudnn autotune, cache fill)
    min_steps: int = 10  # fewer steps after warm-up: abstain with INCOMPLETE_DATA
    window: int = 200  # last N steps per rank that the step verdicts look at
    required_phases: tuple[str, ...] = ("forward", "backward")  # None/0 on every step: not captured
    # A run-wide bound needs this fraction of ranks to show it on their own, so
    # one slow rank (a straggler) never raises a run-wide verdict.
    bound_rank_frac: float = 0.75
    input_bound_frac: float = 0.30  # dataloader share of the step
    input_critical_frac: float = 0.60
    h2d_bound_frac: float = 0.20
    wait_heavy_frac: float = 0.30
    compute_bound_frac: float = 0.60  # forward+backward+optimizer share: healthy, info only
    clock_slack_frac: float = 0.10  # phases may sum to step * (1 + slack) before clocks are doubted
    clock_bad_frac: float = 0.20  # fraction of inconsistent steps that makes a rank's clocks suspect


@dataclass(frozen=True)
class StragglerPolicy:
    min_excess_ms: float = 2.0  # absolute floor: ignore sub-ms jitter on tiny steps
    min_excess_frac: float = 0.10  # of the others' median step time
    critical_excess_frac: float = 0.50
    explain_frac: float = 0.50  # a phase group must explain this share of the gap to be named
    node_min_ranks: int = 2  # a "node" verdict needs a node with at least this many ranks
    # The why text says how much longer the others wait for the straggler in the
    # collective only above this: a smaller difference is timer noise, not evidence.
    wait_gap_min_ms: float = 0.5
    max_rank_verdicts: int = 16  # beyond this, stragglers are listed in one run verdict


@dataclass(frozen=True)
class MemoryPolicy:
    high_pressure_frac: float = 0.90  # peak / device capacity
    critical_pressure_frac: float = 0.97
    imbalance_frac: float = 0.20  # (max - min) / max across ranks
    imbalance_min_bytes: int = 256 * 2**20
    creep_segments: int = 4  # series cut in N parts; creep = every part's median above the last
    creep_min_frac: float = 0.002  # growth first -> last part, of the first part
    creep_min_bytes: int = 8 * 2**20
    creep_confirm_steps: int = 100  # fewer steps: CREEP_EARLY (info), more: CREEP_CONFIRMED (warn)
    creep_confirm_frac: float = 0.02
    creep_confirm_full_steps: int = 100_000  # ... or projected to fill the device within this many steps


@dataclass(frozen=True)
class SystemPolicy:
    min_samples: int = 3
    low_gpu_util_pct: float = 50.0
    hot_gpu_c: float = 85.0
    host_mem_frac: float = 0.95
    host_mem_critical_frac: float = 0.99  # used / total: the OOM killer or swap is imminent
    host_cpu_pct: float = 95.0


@dataclass(frozen=True)
class LivenessPolicy:
    # In one phase (or silent) this long: stalled. Well under any collective
    # timeout (NCCL/gloo default to minutes), so the evidence is still there.
    stall_s: float = 15.0
    stall_step_factor: float = 20.0  # ... or this many median steps, whichever is longer
    # Each rank's last N steps give that median: recent enough to follow a run that
    # slowed down, long enough that one slow step does not stretch the limit.
    step_median_window: int = 50
    max_rank_verdicts: int = 16


@dataclass(frozen=True)
class ComparePolicy:
    regression_pct: float = 5.0  # |B - A| / A above this: REGRESSION / IMPROVEMENT
    min_delta_ms: float = 0.5  # and at least this many ms (timer noise on tiny phases)


@dataclass(frozen=True)
class NumericsPolicy:
    max_ranks_listed: int = 16  # ranks that went non-finite after the first, in the evidence
    replica_min_ranks: int = 2  # REPLICA_DIVERGED: ranks with fingerprints needed to compare replicas
    max_layers_listed: int = 8  # GRAD_NONFINITE: layers named in the evidence


@dataclass(frozen=True)
class RolloutPolicy:
    min_sessions: int = 20  # fewer finalized sessions (of a phase): no rollout verdict
    tail_ratio: float = 5.0  # p99 / p50 of a phase at least this: ROLLOUT_LONG_TAIL
    tail_min_s: float = 0.05  # ... and p99 - p50 at least this (sub-ms jitter is no tail)
    dominate_frac: float = 0.50  # a phase's median share of the session: ROLLOUT_PHASE_DOMINATES
    reject_frac: float = 0.30  # sessions not accepted, of those finalized: ROLLOUT_REJECTIONS_HIGH
    reject_critical_frac: float = 0.60
    stuck_factor: float = 5.0  # pending longer than this x the p95 session total: ROLLOUT_SESSIONS_STUCK
    stuck_min_s: float = 10.0  # ... and at least this long
    starved_frac: float = 0.30  # trainer time waiting for rollouts: TRAINER_STARVED_BY_ROLLOUTS
    max_listed: int = 10  # sessions or phases named in the evidence


@dataclass(frozen=True)
class Policy:
    steps: StepPolicy = field(default_factory=StepPolicy)
    stragglers: StragglerPolicy = field(default_factory=StragglerPolicy)
    memory: MemoryPolicy = field(default_factory=MemoryPolicy)
    system: SystemPolicy = field(default_factory=SystemPolicy)
    liveness: LivenessPolicy = field(default_factory=LivenessPolicy)
    compare: ComparePolicy = field(default_factory=ComparePolicy)
    numerics: NumericsPolicy = field(default_factory=NumericsPolicy)
    rollouts: RolloutPolicy = field(default_factory=RolloutPolicy)


DEFAULT_POLICY = Policy()
