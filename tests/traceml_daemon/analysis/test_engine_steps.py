"""Step and straggler verdicts of the engine on synthetic runs."""

from __future__ import annotations

from tests.traceml_daemon.analysis.synth import make_rank, make_run
from traceml_daemon.analysis.engine import diagnose
from traceml_daemon.analysis.model import Verdict

BOUNDS = {"INPUT_BOUND", "H2D_BOUND", "WAIT_HEAVY", "COMPUTE_BOUND"}
STRAGGLERS = {"INPUT_STRAGGLER", "H2D_STRAGGLER", "COMPUTE_STRAGGLER", "STRAGGLER", "NODE_STRAGGLER"}


def names(vs: list[Verdict]) -> list[str]:
    return [v.name for v in vs]


def problems(vs: list[Verdict]) -> list[Verdict]:
    return [v for v in vs if v.severity != "info"]


def test_healthy_run_has_no_warnings() -> None:
    vs = diagnose(make_run([make_rank(r, node_rank=r // 2) for r in range(4)]))
    assert problems(vs) == []
    assert names(vs) == ["COMPUTE_BOUND"]
    assert "healthy" in vs[0].why and vs[0].next_step


def test_ddp_backward_straggler_hidden_by_equal_step_times() -> None:
    # Both ranks report 130 ms steps: rank 1 spends +40 ms in backward, rank 0 waits 40 ms more.
    a = make_rank(0, step_ms=130, backward=40, wait=44)
    b = make_rank(1, step_ms=130, backward=80, wait=4)
    vs = diagnose(make_run([a, b]))
    strag = [v for v in vs if v.name in STRAGGLERS]
    assert names(strag) == ["COMPUTE_STRAGGLER"]
    v = strag[0]
    assert v.scope["global_rank"] == 1
    assert v.evidence["phase"] == "backward"
    assert abs(v.evidence["excess_ms"] - 40) < 1
    assert "wait" in v.why
    assert not BOUNDS & set(names(vs))
    assert vs[0] is v  # primary


def test_two_ranks_one_slow_dataloader_is_a_rank_straggler_not_input_bound() -> None:
    # Rank 1's dataloader alone is 45 ms of a ~140 ms step (> 30 %): averaging would call the run input bound.
    a = make_rank(0, wait=44.0)
    b = make_rank(1, dataloader=45.0)
    vs = diagnose(make_run([a, b]))
    assert [v.name for v in problems(vs)] == ["INPUT_STRAGGLER"]
    assert problems(vs)[0].scope == {"global_rank": 1}
    assert problems(vs)[0].evidence["phase"] == "dataloader"


def test_all_ranks_slow_dataloader_is_input_bound() -> None:
    vs = diagnose(make_run([make_rank(r, dataloader=60.0) for r in range(4)]))
    assert names(problems(vs)) == ["INPUT_BOUND"]
    v = problems(vs)[0]
    assert v.scope == {} and v.evidence["share"] > 0.3
    assert "num_workers" in v.next_step and "pin_memory" in v.next_step
    assert not STRAGGLERS & set(names(vs))


def test_h2d_and_wait_bounds() -> None:
    assert "H2D_BOUND" in names(diagnose(make_run([make_rank(r, h2d=40.0) for r in range(3)])))
    assert "WAIT_HEAVY" in names(diagnose(make_run([make_rank(r, wait=60.0) for r in range(3)])))


def test_node_straggler_replaces_rank_verdicts() -> None:
    ranks = [
        make_rank(r, node_rank=r // 2, dataloader=45.0 if r >= 2 else 5.0, wait=4.0 if r >= 2 else 44.0)
        for r in range(4)
    ]
    vs = diagnose(make_run(ranks))
    assert names(problems(vs)) == ["NODE_STRAGGLER"]
    v = problems(vs)[0]
    assert v.scope == {"node_rank": 1}
    assert v.evidence["phase"] == "dataloader"
    assert v.evidence["ranks"] == "2-3"
    assert v.evidence["worst_rank"] == 2  # busy ties: the lower rank


def test_a_node_stragglers_worst_rank_is_its_busiest_member() -> None:
    ranks = [
        make_rank(r, node_rank=r // 2, dataloader={2: 45.0, 3: 55.0}.get(r, 5.0), wait=4.0 if r >= 2 else 44.0)
        for r in range(4)
    ]
    v = problems(diagnose(make_run(ranks)))[0]
    assert v.name == "NODE_STRAGGLER" and v.evidence["worst_rank"] == 3


def test_one_slow_rank_on_a_node_is_not_a_node_straggler() -> None:
    ranks = [make_rank(r, node_rank=r // 2, backward=90.0 if r == 3 else 50.0) for r in range(4)]
    vs = problems(diagnose(make_run(ranks)))
    assert names(vs) == ["COMPUTE_STRAGGLER"]
    assert vs[0].scope == {"global_rank": 3, "node_rank": 1}


def test_4096_ranks_one_straggler() -> None:
    ranks = [make_rank(r, n=16, node_rank=r // 8, backward=90.0 if r == 1234 else 50.0) for r in range(4096)]
    vs = problems(diagnose(make_run(ranks)))
    assert names(vs) == ["COMPUTE_STRAGGLER"]
    assert vs[0].scope["global_rank"] == 1234


def test_unexplained_gap_is_plain_straggler() -> None:
    a = make_rank(0, step_ms=100.0, wait=None)
    b = make_rank(1, step_ms=140.0, wait=None)
    vs = problems(diagnose(make_run([a, b], parallelism="single")))
    assert names(vs) == ["STRAGGLER"]
    assert vs[0].scope == {"global_rank": 1}


def test_warmup_and_too_few_steps_abstain() -> None:
    vs = diagnose(make_run([make_rank(r, n=4, dataloader=200.0) for r in range(2)]))
    assert names(vs) == ["WARMUP"]
    vs = diagnose(make_run([make_rank(r, n=10, dataloader=200.0) for r in range(2)]))
    assert names(vs) == ["INCOMPLETE_DATA"]
    assert vs[0].evidence["reason"] == "too_few_steps"
    assert diagnose(make_run([]))[0].evidence["reason"] == "no_steps"


def test_forward_never_captured_abstains_from_bounds() -> None:
    for missing in (None, 0.0):
        vs = diagnose(make_run([make_rank(r, forward=missing, dataloader=60.0) for r in range(2)]))
        incomplete = [v for v in vs if v.name == "INCOMPLETE_DATA"]
        assert [v.evidence["phase"] for v in incomplete] == ["forward"]
        assert "model.forward" in incomplete[0].next_step
        assert not BOUNDS & set(names(vs))


def test_inconsistent_clocks_abstain() -> None:
    # Phases sum to ~150 ms but the step says 50 ms.
    vs = diagnose(make_run([make_rank(r, step_ms=50.0, dataloader=60.0) for r in range(2)]))
    assert [v.evidence["reason"] for v in vs if v.name == "INCOMPLETE_DATA"] == ["inconsistent_clocks"]
    assert not BOUNDS & set(names(vs))


def test_evidence_is_json_ready() -> None:
    import json

    a = make_rank(0, step_ms=130, backward=40, wait=44)
    b = make_rank(1, step_ms=130, backward=80, wait=4)
    json.dumps([v.to_json() for v in diagnose(make_run([a, b]))])


def test_residual_wait_outside_ddp_counts_as_the_ranks_own_time() -> None:
    # Without DDP, wait is the unmeasured rest of the step: a rank slow there is still a straggler.
    a = make_rank(0, wait=4.0)
    b = make_rank(1, wait=60.0)
    vs = problems(diagnose(make_run([a, b], parallelism="single")))
    assert names(vs) == ["STRAGGLER"] and vs[0].scope == {"global_rank": 1}
