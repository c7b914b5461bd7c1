"""Input and output types of the analysis engine (stdlib only, no I/O).

Loaders (the summary's SQL reader, the daemon's live aggregates, the TUI's
data module) build a ``RunData``; the engine turns it into ``Verdict`` s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from traceml_daemon.analysis.fingerprints import FingerprintEvidence

PHASES = ("dataloader", "h2d", "forward", "backward", "optimizer", "wait")
SEVERITIES = ("info", "warn", "critical")


@dataclass
class RankStatus:
    """Where a rank is right now (from the agent's latest status row)."""

    ts: float  # wall clock of the report
    phase: str  # idle|dataloader|h2d|forward|backward|optimizer|wait
    phase_since: float  # wall clock the phase began
    step: int | None
    steps_done: int
    finished: bool


@dataclass
class RankData:
    """One rank's step series, oldest first. Lists are parallel to ``steps``;
    ``None`` inside a list means "not measured" for that step."""

    global_rank: int
    local_rank: int | None = None
    node_rank: int | None = None
    hostname: str | None = None
    steps: list[int] = field(default_factory=list)
    step_ns: list[int | None] = field(default_factory=list)
    phases_ns: dict[str, list[int | None]] = field(default_factory=dict)  # keys from PHASES
    comm_ns: list[int | None] = field(default_factory=list)  # measured all-reduce (DDP)
    peak_bytes: list[int | None] = field(default_factory=list)  # device peak per step
    reserved_bytes: list[int | None] = field(default_factory=list)
    rss_bytes: list[int | None] = field(default_factory=list)
    step_ts: list[float | None] = field(default_factory=list)  # wall clock at step end
    # FSDP2: collective time measured inside forward / backward, its part on HSDP's
    # replicate dimension, device memory after forward (store.read.fsdp2; empty elsewhere).
    fwd_comm_ns: list[int | None] = field(default_factory=list)
    bwd_comm_ns: list[int | None] = field(default_factory=list)
    replicate_comm_ns: list[int | None] = field(default_factory=list)
    post_forward_bytes: list[int | None] = field(default_factory=list)
    status: RankStatus | None = None
    device_total_bytes: int | None = None  # device memory capacity when known
    # Steps stored for this rank when ``steps`` is a sample of them (a long run's summary
    # reads every k-th step plus the newest ones dense); None: ``steps`` holds them all.
    steps_stored: int | None = None


@dataclass
class NodeSystem:
    """Latest-window host and GPU samples of one node (None = absent)."""

    node_rank: int
    hostname: str | None = None
    cpu_pct: list[float | None] = field(default_factory=list)
    mem_used_bytes: list[int | None] = field(default_factory=list)
    mem_total_bytes: int | None = None
    gpu_util_pct: dict[int, list[float | None]] = field(default_factory=dict)  # gpu index -> samples
    gpu_temp_c: dict[int, list[float | None]] = field(default_factory=dict)
    gpu_mem_used_bytes: dict[int, list[int | None]] = field(default_factory=dict)
    gpu_mem_total_bytes: dict[int, int | None] = field(default_factory=dict)


@dataclass(frozen=True)
class NonFinite:
    """The first step at which one rank's logged scalar was NaN or infinite."""

    global_rank: int
    name: str
    step: int
    value: float  # nan, inf or -inf


@dataclass
class RunData:
    ranks: list[RankData]
    parallelism: str = "single"  # single|ddp|fsdp2
    now: float | None = None  # wall clock "now" for live checks; None for a finished run
    live: bool = False  # True when diagnosing a run in progress (enables HANG/RANK_STALLED)
    systems: list[NodeSystem] = field(default_factory=list)
    nonfinite: list[NonFinite] = field(default_factory=list)  # first non-finite scalar per rank and name
    fingerprints: FingerprintEvidence | None = None  # numerics fingerprints' findings (analysis/fingerprints.py)


@dataclass
class Verdict:
    name: str
    severity: str  # info|warn|critical
    scope: dict[str, int]  # {} for the run, {"node_rank": n} or {"global_rank": r}
    why: str  # one line a person can check against the evidence
    evidence: dict[str, Any] = field(default_factory=dict)
    next_step: str = ""  # what to try next

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "severity": self.severity,
            "scope": dict(self.scope),
            "why": self.why,
            "evidence": dict(self.evidence),
            "next_step": self.next_step,
        }
