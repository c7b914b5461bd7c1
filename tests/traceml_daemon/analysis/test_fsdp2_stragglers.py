"""Stragglers under FSDP2: busy time is each phase less the collective wait measured inside it.

Synthetic runs in ms (``synth.BASE``). Under FSDP2 the ranks wait for one another
inside forward (all-gather) and backward (reduce-scatter): a rank slow in its own
backward makes every rank's backward as long as its own, and only the measured
wait tells the culprit from the ranks waiting for it.
"""

from __future__ import annotations

from tests.traceml_daemon.analysis.synth import BASE, MS, make_rank, make_run
from traceml_daemon.analysis.engine import diagnose
from traceml_daemon.analysis.model import RankData, Verdict
from traceml_daemon.analysis.window import profiles

STRAGGLERS = {"INPUT_STRAGGLER", "H2D_STRAGGLER", "COMPUTE_STRAGGLER", "WAIT_STRAGGLER", "STRAGGLER", "NODE_STRAGGLER"}
SLOW = 40.0  # ms of extra own backward work on the slow rank


def stragglers(vs: list[Verdict]) -> list[Verdict]:
    return [v for v in vs if v.name in STRAGGLERS]


def fsdp2_rank(rank: int, fwd_comm: float, bwd_comm: float, replicate: float | None = None,
               measured: bool = True, world: int = 2) -> RankData:
    """Every rank's phases as long as the slowest's (synchronised by the collectives)."""
    r = make_rank(rank, backward=BASE["backward"] + SLOW)
    n = len(r.steps)
    if measured:
        r.fwd_comm_ns = [int(fwd_comm * MS)] * n
        r.bwd_comm_ns = [int(bwd_comm * MS)] * n
        r.replicate_comm_ns = [int((replicate or 0.0) * MS)] * n
    return r


def slow_pair(measured: bool = True) -> list[RankData]:
    # rank 1 computes SLOW ms longer in backward; rank 0 waits for it in the reduce-scatter
    return [fsdp2_rank(0, 3.0, 5.0 + SLOW, measured=measured), fsdp2_rank(1, 3.0, 5.0, measured=measured)]


def test_the_rank_slow_in_its_own_backward_is_named_and_the_waiting_rank_is_not() -> None:
    strag = stragglers(diagnose(make_run(slow_pair(), parallelism="fsdp2")))
    assert [(v.name, v.scope["global_rank"]) for v in strag] == [("COMPUTE_STRAGGLER", 1)]
    v = strag[0]
    assert v.evidence["phase"] == "backward"
    assert abs(v.evidence["excess_ms"] - SLOW) < 0.5
    # how much of each phase was waiting, here and on the others
    assert v.evidence["collective_wait_ms"] == {"forward": 3.0, "backward": 5.0, "replicate": 0.0}
    assert v.evidence["others_collective_wait_ms"]["backward"] == 5.0 + SLOW
    assert "waiting in collectives" in v.why and f"{5.0 + SLOW:.1f} ms on the others" in v.why


def test_without_measured_wait_the_same_run_cannot_tell_them_apart() -> None:
    # What the agent reported before FSDP2 timing: identical steps, no straggler named.
    assert stragglers(diagnose(make_run(slow_pair(measured=False), parallelism="fsdp2"))) == []


def test_four_ranks_only_the_slow_one_is_named() -> None:
    ranks = [fsdp2_rank(r, 3.0, 5.0 + SLOW) for r in (0, 1, 3)] + [fsdp2_rank(2, 3.0, 5.0)]
    strag = stragglers(diagnose(make_run(ranks, parallelism="fsdp2")))
    assert [(v.name, v.scope["global_rank"]) for v in strag] == [("COMPUTE_STRAGGLER", 2)]


def test_balanced_fsdp2_names_no_straggler() -> None:
    ranks = [make_rank(r) for r in range(4)]
    for r in ranks:
        r.fwd_comm_ns = [3 * MS] * len(r.steps)
        r.bwd_comm_ns = [6 * MS] * len(r.steps)
        r.replicate_comm_ns = [2 * MS] * len(r.steps)
    assert stragglers(diagnose(make_run(ranks, parallelism="fsdp2"))) == []


def test_profile_nets_the_wait_out_of_busy_time_and_phases() -> None:
    (waiting, slow) = profiles(make_run(slow_pair(), parallelism="fsdp2"), 0, None, 0.05)
    assert waiting.step_ms == slow.step_ms
    assert abs((waiting.step_ms or 0) - (waiting.busy_ms or 0) - (3.0 + 5.0 + SLOW)) < 0.5
    assert waiting.phases_ms["backward"] == slow.phases_ms["backward"]  # as measured, wait included
    assert abs((slow.work_ms["backward"] or 0) - (waiting.work_ms["backward"] or 0) - SLOW) < 0.5
    assert waiting.comm_ms == {"forward": 3.0, "backward": 45.0, "replicate": 0.0}
