"""Thresholds that used to be literals in the domains now come from the policy:
each test moves one policy knob and checks the verdict follows it."""

from __future__ import annotations

from dataclasses import replace

from tests.traceml_daemon.analysis.synth import BASE, MS, make_rank, make_run
from traceml_daemon.analysis.engine import diagnose
from traceml_daemon.analysis.model import NodeSystem, RankStatus, Verdict
from traceml_daemon.analysis.policy import DEFAULT_POLICY, Policy

GiB = 2**30


def _only(vs: list[Verdict], name: str) -> Verdict:
    (v,) = [v for v in vs if v.name == name]
    return v


def _host_mem(used_frac: float, policy: Policy = DEFAULT_POLICY) -> Verdict:
    node = NodeSystem(node_rank=0, mem_used_bytes=[int(used_frac * 64 * GiB)] * 5, mem_total_bytes=64 * GiB)
    return _only(diagnose(make_run([make_rank(0)], systems=[node]), policy), "HOST_MEM_SATURATED")


def test_host_memory_critical_fraction_comes_from_the_policy() -> None:
    assert _host_mem(0.97).severity == "warn"
    assert _host_mem(0.995).severity == "critical"
    lower = replace(DEFAULT_POLICY, system=replace(DEFAULT_POLICY.system, host_mem_critical_frac=0.96))
    assert _host_mem(0.97, lower).severity == "critical"


def _stalled_run(now: float) -> list:
    # 100 steps: the first 60 slow (2 s), the last 40 fast (0.1 s); rank 1 sits in backward for 25 s.
    ranks = []
    for r in range(2):
        rank = make_rank(r, n=100)
        rank.step_ns = [2000 * MS] * 60 + [100 * MS] * 40
        phase, since = ("backward", now - 25.0) if r == 1 else ("wait", now - 24.0)
        rank.status = RankStatus(ts=now - 0.5, phase=phase, phase_since=since, step=100, steps_done=100, finished=False)
        ranks.append(rank)
    return ranks


def test_stall_limit_uses_the_policy_window_of_recent_steps() -> None:
    now = 50_000.0
    # Default window (last 50 steps): median 0.1 s, so the limit is the 15 s floor and 25 s is a hang.
    hang = _only(diagnose(make_run(_stalled_run(now), live=True, now=now)), "HANG")
    assert hang.scope["global_rank"] == 1 and hang.evidence["limit_s"] == DEFAULT_POLICY.liveness.stall_s
    # A window over all 100 steps sees a 2 s median: limit 20 x 2 s = 40 s, so 25 s is not yet a stall.
    wide = replace(DEFAULT_POLICY, liveness=replace(DEFAULT_POLICY.liveness, step_median_window=100))
    vs = diagnose(make_run(_stalled_run(now), live=True, now=now), wide)
    assert not [v for v in vs if v.name in ("HANG", "RANK_STALLED")], vs


def _backward_straggler() -> list:
    # DDP: rank 3 computes 30 ms longer in backward, the others wait those 30 ms in the all-reduce.
    return [
        make_rank(r, node_rank=0, backward=80.0 if r == 3 else 50.0, wait=1.0 if r == 3 else 31.0) for r in range(4)
    ]


def test_wait_gap_is_mentioned_only_above_the_policy_minimum() -> None:
    v = _only(diagnose(make_run(_backward_straggler())), "COMPUTE_STRAGGLER")
    assert v.scope["global_rank"] == 3 and "backward" in v.why
    assert "the others wait 30.0 ms more for it in the collective" in v.why
    strict = replace(DEFAULT_POLICY, stragglers=replace(DEFAULT_POLICY.stragglers, wait_gap_min_ms=50.0))
    quiet = _only(diagnose(make_run(_backward_straggler()), strict), "COMPUTE_STRAGGLER")
    assert quiet.scope["global_rank"] == 3 and "wait" not in quiet.why


def _compute_stragglers(extra_ms: float, scale: float = 1.0) -> list[Verdict]:
    # DDP: rank 3 spends extra_ms more in backward; the others wait that long in the all-reduce,
    # so every rank's step is the same and only busy time tells them apart.
    def phases(r: int) -> dict[str, float]:
        base = {p: v * scale for p, v in BASE.items()}
        if r == 3:
            base["backward"] += extra_ms
        else:
            base["wait"] += extra_ms
        return base

    run = make_run([make_rank(r, node_rank=0, **phases(r)) for r in range(4)])
    return [v for v in diagnose(run) if v.name == "COMPUTE_STRAGGLER"]


def test_straggler_threshold_is_relative_to_the_others_step_on_both_sides() -> None:
    # Threshold: min_excess_frac (10%) of the others' step, here 0.1 x (100 + extra) ms.
    (named,) = _compute_stragglers(13.0)  # 13 ms > 11.3 ms: a straggler
    assert named.scope["global_rank"] == 3
    assert _compute_stragglers(9.0) == []  # 9 ms < 10.9 ms: jitter, not a straggler


def test_straggler_floor_in_ms_applies_to_tiny_steps() -> None:
    # 10 ms steps: 10% is 1 ms, so the absolute floor (min_excess_ms, 2 ms) decides.
    (named,) = _compute_stragglers(2.5, scale=0.1)
    assert named.scope["global_rank"] == 3
    assert _compute_stragglers(1.5, scale=0.1) == []
