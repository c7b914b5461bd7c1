"""Which ranks were outside the band at one step, and by how much.

The band is the straggler rule's (``stragglers.rank_excesses``) applied to a
single step: each rank's busy time against the median of the others, a rank
out of band when its excess passes the policy's floor, named by the phase
group that explains the gap, as the rank verdicts name it.
"""

from __future__ import annotations

from dataclasses import dataclass

from traceml_daemon.analysis.model import RunData
from traceml_daemon.analysis.policy import DEFAULT_POLICY, Policy
from traceml_daemon.analysis.stats import round_ms
from traceml_daemon.analysis.stragglers import GROUP_VERDICT, attribute_rank, rank_excesses
from traceml_daemon.analysis.window import collective_coupled, profiles


@dataclass(frozen=True)
class OutOfBand:
    global_rank: int
    node_rank: int | None
    excess_ms: float  # busy time above the others' median
    busy_ms: float
    others_busy_ms: float
    others_step_ms: float
    phase: str | None  # the phase that explains the gap, None when no measured one does
    phase_excess_ms: float | None
    name: str  # the verdict a run of such steps gets: COMPUTE_STRAGGLER, ...

    def to_json(self) -> dict[str, object]:
        return {
            "global_rank": self.global_rank,
            "node_rank": self.node_rank,
            "excess_ms": round_ms(self.excess_ms),
            "busy_ms": round_ms(self.busy_ms),
            "others_busy_ms": round_ms(self.others_busy_ms),
            "others_step_ms": round_ms(self.others_step_ms),
            "phase": self.phase,
            "phase_excess_ms": round_ms(self.phase_excess_ms),
            "verdict": self.name,
        }


def out_of_band(run: RunData, policy: Policy | None = None) -> list[OutOfBand]:
    """The ranks of ``run`` (each holding the one step looked at) outside the band, worst first."""
    policy = policy or DEFAULT_POLICY
    profs = profiles(run, 0, None, policy.steps.clock_slack_frac)
    coupled = collective_coupled(run)
    out: list[OutOfBand] = []
    for e in rank_excesses(profs, policy.stragglers, coupled):
        group, phase = attribute_rank(e, policy.stragglers, True)
        if phase is None:
            phase_excess = None
        elif phase == "wait":
            phase_excess = e.wait_slot_excess
        else:
            phase_excess = e.phase_excess.get(phase)
        out.append(
            OutOfBand(
                e.ranks[0], e.node_rank, e.excess_ms, e.busy_ms, e.others_busy_ms, e.others_step_ms, phase,
                phase_excess, GROUP_VERDICT[group] if group else "STRAGGLER",
            )
        )
    return out
