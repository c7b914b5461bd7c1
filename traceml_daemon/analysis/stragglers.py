"""Rank and node stragglers, including the ones DDP synchronization hides.

In DDP every rank's step time is the same: fast ranks sit in the all-reduce
(the wait phase) until the slow one arrives. So ranks are compared on their
*busy* time (step minus wait), each against the median of the OTHER ranks
(with 2 ranks: against the other one), and the gap is attributed to the phase
group whose excess explains it. All of it is O(ranks log ranks).

The verdict names the group: INPUT_STRAGGLER, H2D_STRAGGLER, COMPUTE_STRAGGLER
for a measured phase group that explains ``explain_frac`` of the gap, then
WAIT_STRAGGLER, else STRAGGLER (mixed, or nothing measured explains it).

WAIT_STRAGGLER, precisely. A step's *wait slot* is everything in it outside
the measured phases (dataloader, h2d, forward, backward, optimizer). The
agent stores it in ``wait`` in one of two ways: under DDP with its comm hook,
``wait`` is only the measured time blocked on the all-reduce (taken out of
backward, and out of busy time here) and the rest of the slot is stored
nowhere; otherwise (FSDP2, a user's own DDP comm hook, no wrapper) ``wait``
is the whole slot, a residual. The rank's *own* part of the slot is its busy
time less its phases' medians: the unmeasured remainder under DDP, the whole
residual where busy time is the step. WAIT_STRAGGLER names a rank when no
phase group explains the gap and that own part of the slot does, in a run
whose ranks the agent saw step together (DDP or FSDP2, or a measured
all-reduce; ``window.collective_coupled``), where that time is what the others
wait for. In a "single" run (no wrapper, no measured collective) nothing says
anyone waits: the same gap stays STRAGGLER, "work not in any measured phase".
Under a user's DDP comm hook the residual is taken out of busy time as if it
were a measured wait, so host work there is not seen at all.

Under FSDP2 the ranks wait for one another inside forward (all-gather) and
backward (reduce-scatter, HSDP's all-reduce), so a rank waiting for a slow peer
has phases as long as the peer's. Where the agent measured that collective time
(``window.RankProfile.comm_ms``), busy time is the step less it and each phase is
compared less the wait inside it (``work_ms``): the rank slow in its own compute
is named, the ranks waiting for it are not, and the evidence carries each one's
wait per phase (``collective_wait_ms``, ``others_collective_wait_ms``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from traceml_daemon.analysis.model import Verdict
from traceml_daemon.analysis.policy import StragglerPolicy
from traceml_daemon.analysis.stats import median, others_median, rank_ranges, round_ms
from traceml_daemon.analysis.window import RankProfile

# Phase groups a straggler is named by: compute covers forward, backward and optimizer.
GROUPS: dict[str, tuple[str, ...]] = {
    "input": ("dataloader",),
    "h2d": ("h2d",),
    "compute": ("forward", "backward", "optimizer"),
}
ATTRIBUTED = tuple(p for group in GROUPS.values() for p in group)
# Not a phase group: the rank's own time in the wait slot, derived from the others (see above).
WAIT = "wait"
# FSDP2's measured collective wait, by where it happened (replicate: HSDP's all-reduce, in backward).
COMM_KEYS = ("forward", "backward", "replicate")
GROUP_VERDICT = {
    "input": "INPUT_STRAGGLER",
    "h2d": "H2D_STRAGGLER",
    "compute": "COMPUTE_STRAGGLER",
    WAIT: "WAIT_STRAGGLER",
}


@dataclass
class Excess:
    """One rank (or node) against the others: how much more work, and where."""

    ranks: list[int]
    node_rank: int | None
    excess_ms: float  # busy time above the others' median
    busy_ms: float
    others_busy_ms: float
    others_step_ms: float
    wait_ms: float | None
    others_wait_ms: float | None
    phase_excess: dict[str, float] = field(default_factory=dict)
    group_excess: dict[str, float] = field(default_factory=dict)
    # The rank's own wait-slot time above the others' median; None where the run's
    # ranks are not known to step together (WAIT_STRAGGLER does not apply).
    wait_slot_excess: float | None = None
    # FSDP2: collective wait measured inside its phases (COMM_KEYS), and the others' median.
    comm_ms: dict[str, float | None] | None = None
    others_comm_ms: dict[str, float] | None = None
    worst_rank: int | None = None  # a node's member with the most busy time (the one to look at first)


def _group_ms(p: RankProfile, group: str) -> float:
    return sum(_work(p, ph) for ph in GROUPS[group])


def _work(p: RankProfile, phase: str) -> float:
    """The phase's own work: less the collective wait measured inside it (FSDP2), else the phase."""
    return (p.work_ms or p.phases_ms).get(phase) or 0.0


def wait_slot_ms(p: RankProfile) -> float:
    """The rank's own time outside every measured phase: busy time less the phases' medians."""
    return (p.busy_ms or 0.0) - sum(_work(p, ph) for ph in ATTRIBUTED)


def rank_excesses(profs: list[RankProfile], policy: StragglerPolicy, coupled: bool = False) -> list[Excess]:
    """Ranks whose busy time exceeds the other ranks' median by the policy threshold, worst first.

    ``coupled``: the ranks step together (``window.collective_coupled``), so each
    excess also carries its wait-slot part, which WAIT_STRAGGLER is named by."""
    ranks = [p for p in profs if p.busy_ms is not None and p.step_ms is not None]
    if len(ranks) < 2:
        return []
    busy = others_median([p.busy_ms or 0.0 for p in ranks])
    step = others_median([p.step_ms or 0.0 for p in ranks])
    wait = others_median([p.phases_ms.get("wait") or 0.0 for p in ranks])
    phase_ref = {ph: others_median([_work(p, ph) for p in ranks]) for ph in ATTRIBUTED}
    comm_ref = {k: others_median([p.comm_ms.get(k) or 0.0 for p in ranks]) for k in COMM_KEYS}
    slot = [wait_slot_ms(p) for p in ranks] if coupled else []
    slot_ref = others_median(slot) if coupled else []
    out: list[Excess] = []
    for i, p in enumerate(ranks):
        ref_busy, ref_step = busy[i] or 0.0, step[i] or 0.0
        excess = (p.busy_ms or 0.0) - ref_busy
        if excess < max(policy.min_excess_ms, policy.min_excess_frac * ref_step):
            continue
        phase_excess = {ph: _work(p, ph) - (phase_ref[ph][i] or 0.0) for ph in ATTRIBUTED}
        out.append(
            Excess(
                [p.global_rank],
                p.node_rank,
                excess,
                p.busy_ms or 0.0,
                ref_busy,
                ref_step,
                p.phases_ms.get("wait"),
                wait[i],
                phase_excess,
                {g: sum(phase_excess[ph] for ph in phs) for g, phs in GROUPS.items()},
                slot[i] - (slot_ref[i] or 0.0) if coupled else None,
                dict(p.comm_ms) if p.comm_ms else None,
                {k: comm_ref[k][i] or 0.0 for k in COMM_KEYS} if p.comm_ms else None,
            )
        )
    out.sort(key=lambda e: -e.excess_ms)
    return out


def node_excesses(profs: list[RankProfile], policy: StragglerPolicy) -> list[Excess]:
    """Nodes where EVERY rank is slower than the other nodes' median: the node's
    least-slow rank is compared with the others' median, so one bad rank does not
    make a node verdict."""
    nodes: dict[int, list[RankProfile]] = {}
    for p in profs:
        if p.node_rank is not None and p.busy_ms is not None and p.step_ms is not None:
            nodes.setdefault(p.node_rank, []).append(p)
    if len(nodes) < 2:
        return []
    keys = sorted(nodes)

    def node_medians(value: Callable[[RankProfile], float | None]) -> list[float]:
        return [median(value(p) for p in nodes[k]) or 0.0 for k in keys]

    ref_busy = others_median(node_medians(lambda p: p.busy_ms))
    ref_step = others_median(node_medians(lambda p: p.step_ms))
    ref_wait = others_median(node_medians(lambda p: p.phases_ms.get("wait") or 0.0))
    ref_phase = {ph: others_median(node_medians(lambda p, ph=ph: _work(p, ph))) for ph in ATTRIBUTED}
    out: list[Excess] = []
    for i, k in enumerate(keys):
        members = nodes[k]
        if len(members) < policy.node_min_ranks:
            continue
        least = min(p.busy_ms or 0.0 for p in members)
        excess = least - (ref_busy[i] or 0.0)
        if excess < max(policy.min_excess_ms, policy.min_excess_frac * (ref_step[i] or 0.0)):
            continue
        # Per phase, the excess every member shares (its minimum over the node).
        phase_excess = {
            ph: min(_work(p, ph) for p in members) - (ref_phase[ph][i] or 0.0) for ph in ATTRIBUTED
        }
        out.append(
            Excess(
                sorted(p.global_rank for p in members),
                k,
                excess,
                median(p.busy_ms for p in members) or 0.0,
                ref_busy[i] or 0.0,
                ref_step[i] or 0.0,
                median(p.phases_ms.get("wait") for p in members),
                ref_wait[i],
                phase_excess,
                {g: sum(phase_excess[ph] for ph in phs) for g, phs in GROUPS.items()},
                worst_rank=max(members, key=lambda p: (p.busy_ms or 0.0, -p.global_rank)).global_rank,
            )
        )
    out.sort(key=lambda e: -e.excess_ms)
    return out


def _attribute(e: Excess, policy: StragglerPolicy, phases_ok: bool) -> tuple[str | None, str | None]:
    """(group, phase) that explains the gap, or (None, None) when no measured phase does."""
    if not phases_ok or not e.group_excess:
        return None, None
    group = max(e.group_excess, key=lambda g: e.group_excess[g])
    if e.group_excess[group] < policy.explain_frac * e.excess_ms:
        return None, None
    phase = max(GROUPS[group], key=lambda ph: e.phase_excess.get(ph, 0.0))
    return group, phase


def _attribute_rank(e: Excess, policy: StragglerPolicy, phases_ok: bool) -> tuple[str | None, str | None]:
    """As ``_attribute``; where no measured group explains the gap, the wait slot may.

    Measured groups come first: their times are measured, the slot is what is left of the step."""
    group, phase = _attribute(e, policy, phases_ok)
    if (
        group is None
        and phases_ok
        and e.wait_slot_excess is not None
        and e.wait_slot_excess >= policy.explain_frac * e.excess_ms
    ):
        return WAIT, WAIT
    return group, phase


# The attribution the rank verdicts use, for views of one step (analysis/step_band.py).
attribute_rank = _attribute_rank


def _severity(e: Excess, policy: StragglerPolicy) -> str:
    return "critical" if e.excess_ms >= policy.critical_excess_frac * e.others_step_ms else "warn"


def _evidence(e: Excess, phase: str | None) -> dict[str, object]:
    ev: dict[str, object] = {
        "excess_ms": round_ms(e.excess_ms),
        "busy_ms": round_ms(e.busy_ms),
        "others_busy_ms": round_ms(e.others_busy_ms),
        "others_step_ms": round_ms(e.others_step_ms),
        "wait_ms": round_ms(e.wait_ms),
        "others_wait_ms": round_ms(e.others_wait_ms),
        "phase_excess_ms": {ph: round_ms(v) for ph, v in e.phase_excess.items()},
    }
    if phase is not None:
        ev["phase"] = phase
    if e.comm_ms is not None and e.others_comm_ms is not None:
        # Phase times include the collectives; phase_excess_ms compares them without.
        ev["collective_wait_ms"] = {k: round_ms(v) for k, v in e.comm_ms.items()}
        ev["others_collective_wait_ms"] = {k: round_ms(v) for k, v in e.others_comm_ms.items()}
    return ev


def _gap_text(e: Excess, phase: str | None, policy: StragglerPolicy) -> str:
    if phase == WAIT and e.wait_slot_excess is not None:
        lead = f"+{e.wait_slot_excess:.1f} ms of its own time in the wait slot, outside every measured phase"
    elif phase is not None:
        lead = f"{phase} +{e.phase_excess[phase]:.1f} ms vs the others' median"
    else:
        lead = f"+{e.excess_ms:.1f} ms of work not in any measured phase"
    text = f"{lead} (busy {e.busy_ms:.1f} ms vs {e.others_busy_ms:.1f} ms)"
    if e.comm_ms is not None and e.others_comm_ms is not None and phase in ("forward", "backward"):
        text += (f"; of its {phase}, {e.comm_ms.get(phase) or 0.0:.1f} ms was waiting in collectives, "
                 f"{e.others_comm_ms.get(phase, 0.0):.1f} ms on the others")
    if e.wait_ms is not None and e.others_wait_ms is not None and e.others_wait_ms - e.wait_ms > policy.wait_gap_min_ms:
        text += f"; the others wait {e.others_wait_ms - e.wait_ms:.1f} ms more for it in the collective"
    return text


def rank_verdicts(
    excesses: list[Excess], policy: StragglerPolicy, phases_ok: bool, skip_nodes: set[int]
) -> list[Verdict]:
    """Rank straggler verdicts, leaving out ranks of nodes that got a NODE_STRAGGLER."""
    kept = [e for e in excesses if e.node_rank is None or e.node_rank not in skip_nodes]
    out: list[Verdict] = []
    for e in kept[: policy.max_rank_verdicts]:
        group, phase = _attribute_rank(e, policy, phases_ok)
        name = GROUP_VERDICT[group] if group else "STRAGGLER"
        rank = e.ranks[0]
        scope = {"global_rank": rank}
        where = f"rank {rank}"
        if e.node_rank is not None:
            scope["node_rank"] = e.node_rank
            where += f" (node {e.node_rank})"
        ev = _evidence(e, phase)
        if group == WAIT and e.wait_slot_excess is not None:
            ev["wait_slot_excess_ms"] = round_ms(e.wait_slot_excess)
        ev["stragglers_total"] = len(kept)
        out.append(
            Verdict(
                name,
                _severity(e, policy),
                scope,
                f"{where} is a straggler: {_gap_text(e, phase, policy)}",
                ev,
                _NEXT[group],
            )
        )
    return out


def node_verdicts(excesses: list[Excess], policy: StragglerPolicy, phases_ok: bool) -> list[Verdict]:
    out: list[Verdict] = []
    for e in excesses:
        group, phase = _attribute(e, policy, phases_ok)
        ev = _evidence(e, phase)
        ev["ranks"] = rank_ranges(e.ranks)
        ev["worst_rank"] = e.worst_rank
        what = f"in {phase}" if phase else "outside the measured phases"
        why = f"every rank of node {e.node_rank} (ranks {rank_ranges(e.ranks)}) is slow {what}: {_gap_text(e, phase, policy)}"
        out.append(
            Verdict("NODE_STRAGGLER", _severity(e, policy), {"node_rank": e.node_rank or 0}, why, ev, _NODE_NEXT[group])
        )
    return out


_NEXT: dict[str | None, str] = {
    "input": "This rank's DataLoader is slower than its peers': check its node's CPU load and storage, balance the "
    "data shards, raise num_workers / prefetch_factor, pin_memory=True.",
    "h2d": "This rank's host-to-device copies are slow: check its GPU's PCIe link and NUMA placement "
    "(nvidia-smi topo -m), use pinned memory and non_blocking=True.",
    "compute": "This rank computes slower: check its GPU's clocks, temperature and throttling "
    "(nvidia-smi -q -d PERFORMANCE), other processes on that GPU, and uneven batch or sequence lengths per rank.",
    WAIT: "This rank's extra time is between the measured phases, and the other ranks wait for it in the "
    "next collective: look on that rank for host work between backward and the optimizer or after the step "
    "(.item()/.cpu() syncs, logging, metric all-reduces or barriers, gradient clipping, checkpoint saves, GC) "
    "and wrap suspects in agent.span(...) to see them in the exported trace.",
    None: "The gap is outside the measured phases: look for host work between phases on that rank "
    "(logging, .item() syncs, checkpointing, GC).",
}
_NODE_NEXT: dict[str | None, str] = {
    "input": "Every rank on this node loads data slowly: check the node's storage, CPU governor and load (top), "
    "and its local data cache; compare with a healthy node or drain it.",
    "h2d": "Every rank on this node copies slowly: check the node's PCIe/NUMA topology (nvidia-smi topo -m) and BIOS settings.",
    "compute": "Every GPU on this node computes slowly: check clocks, power caps and thermal throttling there "
    "(nvidia-smi -q -d PERFORMANCE), or drain the node.",
    None: "The whole node is slow outside the measured phases: check its CPU load, NIC and other jobs sharing it.",
}
