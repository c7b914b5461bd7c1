"""WAIT_STRAGGLER: a rank slower than the others in its own part of the wait slot.

Synthetic runs in ms (``synth.BASE`` phases sum to 96 ms, wait 4 ms). Under
DDP the ranks' steps are equal: a rank's host work outside the phases shows
as the others' longer measured wait, and its own time is stored nowhere
(step minus phases minus wait). The cases sit near and away from the two
thresholds that decide the name: the straggler floor (10% of the step) and
the share of the gap the wait slot must explain (half).
"""

from __future__ import annotations

from tests.traceml_daemon.analysis.synth import BASE, make_rank, make_run
from traceml_daemon.analysis.engine import diagnose
from traceml_daemon.analysis.model import RankData, Verdict
from traceml_daemon.analysis.policy import DEFAULT_POLICY
from traceml_daemon.analysis.report import PRIORITY, sort_verdicts

STRAGGLERS = {"INPUT_STRAGGLER", "H2D_STRAGGLER", "COMPUTE_STRAGGLER", "WAIT_STRAGGLER", "STRAGGLER", "NODE_STRAGGLER"}
STEP = sum(v for v in BASE.values())  # 100 ms


def stragglers(vs: list[Verdict]) -> list[Verdict]:
    return [v for v in vs if v.name in STRAGGLERS]


def ddp_pair(host: float, backward: float = 0.0, dataloader: float = 0.0) -> list[RankData]:
    """Two DDP ranks with equal steps; rank 1 has ``host`` ms outside every phase plus
    phase excesses, and rank 0 waits in the all-reduce for all of it."""
    extra = host + backward + dataloader
    a = make_rank(0, step_ms=STEP + extra, wait=BASE["wait"] + extra)
    b = make_rank(1, step_ms=STEP + extra, backward=BASE["backward"] + backward,
                  dataloader=BASE["dataloader"] + dataloader)
    return [a, b]


def test_host_work_between_phases_under_ddp_is_a_wait_straggler() -> None:
    vs = diagnose(make_run(ddp_pair(host=30.0)))
    strag = stragglers(vs)
    assert [v.name for v in strag] == ["WAIT_STRAGGLER"]
    v = strag[0]
    assert v.scope == {"global_rank": 1}
    assert v.severity == "warn"
    assert v.evidence["phase"] == "wait"
    assert abs(v.evidence["wait_slot_excess_ms"] - 30.0) < 0.5
    assert abs(v.evidence["excess_ms"] - 30.0) < 0.5
    assert "wait slot" in v.why and "the others wait 30.0 ms more" in v.why
    assert "agent.span" in v.next_step and "between backward and the optimizer" in v.next_step
    assert vs[0] is v  # primary
    assert "WAIT_HEAVY" not in {x.name for x in vs}


def test_critical_from_half_the_step() -> None:
    # Critical once the excess is half the others' step: 60 of 160 ms is not, 120 of 220 ms is.
    assert stragglers(diagnose(make_run(ddp_pair(host=60.0))))[0].severity == "warn"
    assert stragglers(diagnose(make_run(ddp_pair(host=120.0))))[0].severity == "critical"


def test_straggler_floor_just_above_and_just_below() -> None:
    # Threshold: 10% of the others' step, 0.1 * (100.1 + host) ms: crossed at about 11.1 ms of host work.
    above = stragglers(diagnose(make_run(ddp_pair(host=11.7))))
    assert [v.name for v in above] == ["WAIT_STRAGGLER"], above
    assert stragglers(diagnose(make_run(ddp_pair(host=10.6)))) == []


def test_wait_slot_just_over_half_the_gap_names_it() -> None:
    # A 40 ms gap: 20.6 ms in the wait slot, 19.4 ms in backward.
    vs = stragglers(diagnose(make_run(ddp_pair(host=20.6, backward=19.4))))
    assert [v.name for v in vs] == ["WAIT_STRAGGLER"], vs


def test_a_measured_group_over_half_keeps_its_name() -> None:
    # The same 40 ms with the shares swapped: backward explains half, so compute is named.
    vs = stragglers(diagnose(make_run(ddp_pair(host=19.4, backward=20.6))))
    assert [v.name for v in vs] == ["COMPUTE_STRAGGLER"] and vs[0].evidence["phase"] == "backward", vs


def test_mixed_gap_just_under_half_everywhere_is_plain_straggler() -> None:
    # 19.4 ms wait slot, 12 ms backward, 8.6 ms dataloader: nothing explains half of the 40 ms.
    vs = stragglers(diagnose(make_run(ddp_pair(host=19.4, backward=12.0, dataloader=8.6))))
    assert [v.name for v in vs] == ["STRAGGLER"], vs
    assert "wait_slot_excess_ms" not in vs[0].evidence and "phase" not in vs[0].evidence


def test_one_of_four_ranks_is_named_and_the_waiters_are_not() -> None:
    ranks = []
    for r in range(4):
        if r == 2:
            ranks.append(make_rank(r, node_rank=r // 2, step_ms=STEP + 25.0))
        else:
            ranks.append(make_rank(r, node_rank=r // 2, step_ms=STEP + 25.0, wait=BASE["wait"] + 25.0))
    vs = stragglers(diagnose(make_run(ranks)))
    assert [(v.name, v.scope["global_rank"]) for v in vs] == [("WAIT_STRAGGLER", 2)], vs


def test_residual_wait_under_fsdp2_is_a_wait_straggler_and_single_stays_straggler() -> None:
    # Without a measured wait the slot is the stored residual; busy time is the whole step.
    a = make_rank(0)
    b = make_rank(1, wait=60.0)
    fsdp2 = stragglers(diagnose(make_run([a, b], parallelism="fsdp2")))
    assert [v.name for v in fsdp2] == ["WAIT_STRAGGLER"] and fsdp2[0].scope == {"global_rank": 1}
    assert abs(fsdp2[0].evidence["wait_slot_excess_ms"] - 56.0) < 0.5
    # No wrapper and no collective seen: nobody is known to wait, the name stays STRAGGLER.
    single = stragglers(diagnose(make_run([a, b], parallelism="single")))
    assert [v.name for v in single] == ["STRAGGLER"]


def test_a_measured_all_reduce_couples_a_run_labelled_single() -> None:
    ranks = ddp_pair(host=30.0)
    for r in ranks:
        r.comm_ns = [1_000_000] * len(r.steps)
    vs = stragglers(diagnose(make_run(ranks, parallelism="single")))
    assert [v.name for v in vs] == ["WAIT_STRAGGLER"], vs


def test_no_wait_straggler_when_forward_was_never_captured() -> None:
    # The slot would hold the uncaptured forward: the phases cannot be trusted to leave a remainder.
    ranks = [make_rank(0, step_ms=STEP + 30.0, wait=BASE["wait"] + 30.0, forward=None),
             make_rank(1, step_ms=STEP + 30.0, forward=None)]
    names = {v.name for v in diagnose(make_run(ranks))}
    assert "WAIT_STRAGGLER" not in names and "INCOMPLETE_DATA" in names


def test_priority_after_the_measured_stragglers_before_the_plain_one() -> None:
    order = [name for name in PRIORITY if name.endswith("STRAGGLER")]
    assert order.index("WAIT_STRAGGLER") == order.index("STRAGGLER") - 1
    assert order.index("WAIT_STRAGGLER") > order.index("H2D_STRAGGLER")
    plain = Verdict("STRAGGLER", "warn", {"global_rank": 0}, "", {}, "")
    wait = Verdict("WAIT_STRAGGLER", "warn", {"global_rank": 1}, "", {}, "")
    assert [v.name for v in sort_verdicts([plain, wait])] == ["WAIT_STRAGGLER", "STRAGGLER"]


def test_a_stricter_explain_share_turns_it_into_a_plain_straggler() -> None:
    # The name follows StragglerPolicy.explain_frac: at 0.8 a 60% share no longer names the slot.
    from dataclasses import replace

    strict = replace(DEFAULT_POLICY, stragglers=replace(DEFAULT_POLICY.stragglers, explain_frac=0.8))
    ranks = ddp_pair(host=24.0, backward=16.0)
    assert [v.name for v in stragglers(diagnose(make_run(ranks)))] == ["WAIT_STRAGGLER"]
    assert [v.name for v in stragglers(diagnose(make_run(ranks), strict))] == ["STRAGGLER"]
