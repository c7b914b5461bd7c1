"""Memory, system, liveness verdicts, node views, stats and the text report."""

from __future__ import annotations

import random

from tests.traceml_daemon.analysis.synth import make_rank, make_run
from traceml_daemon.analysis.engine import diagnose
from traceml_daemon.analysis.model import NodeSystem, RankStatus
from traceml_daemon.analysis.nodes import node_views, skews
from traceml_daemon.analysis.report import format_verdicts
from traceml_daemon.analysis.stats import median, others_median, rank_ranges

MiB = 2**20
GiB = 2**30


def by_name(vs: list, name: str) -> list:
    return [v for v in vs if v.name == name]


def test_rss_creep_confirmed_on_cpu_run() -> None:
    n = 300
    rss = [GiB + i * MiB for i in range(n)]  # +1 MiB per step, monotonic
    vs = diagnose(make_run([make_rank(0, n=n, rss=rss)], parallelism="single"))
    (v,) = by_name(vs, "CREEP_CONFIRMED")
    assert v.severity == "warn" and v.evidence["metric"] == "rss_bytes"
    assert abs(v.evidence["bytes_per_step"] - MiB) < 0.05 * MiB
    assert v.scope == {"global_rank": 0}


def test_short_creep_is_early_and_flat_or_one_step_is_none() -> None:
    n = 40
    vs = diagnose(make_run([make_rank(0, n=n, rss=[GiB + i * MiB for i in range(n)])]))
    assert names_of(vs, "CREEP") == ["CREEP_EARLY"]
    one_step = [GiB] * 20 + [2 * GiB] * 280  # allocator grew once, then flat: not a creep
    assert names_of(diagnose(make_run([make_rank(0, n=300, rss=one_step)])), "CREEP") == []


def names_of(vs: list, prefix: str) -> list[str]:
    return [v.name for v in vs if v.name.startswith(prefix)]


def test_gpu_peak_creep_and_pressure_and_imbalance() -> None:
    n = 200
    cap = 80 * GiB
    ranks = [make_rank(r, n=n, peak=[int(75 * GiB + i * 2 * MiB) for i in range(n)]) for r in range(2)]
    ranks.append(make_rank(2, n=n, peak=[40 * GiB] * n))
    for r in ranks:
        r.device_total_bytes = cap
    vs = diagnose(make_run(ranks))
    (creep,) = by_name(vs, "CREEP_CONFIRMED")
    assert creep.evidence["metric"] == "peak_bytes" and creep.evidence["ranks"] == "0-1"
    assert creep.evidence["steps_to_full"] is not None
    (hp,) = by_name(vs, "HIGH_PRESSURE")
    assert hp.evidence["ranks"] == "0-1"
    (imb,) = by_name(vs, "IMBALANCE")
    assert imb.evidence["min_rank"] == 2


def test_system_findings_per_node() -> None:
    node = NodeSystem(
        node_rank=1,
        hostname="gpu-b",
        cpu_pct=[99.0] * 5,
        mem_used_bytes=[int(0.98 * 64 * GiB)] * 5,
        mem_total_bytes=64 * GiB,
        gpu_util_pct={0: [95.0] * 5, 1: [20.0] * 5},
        gpu_temp_c={0: [70.0, 88.0, 71.0], 1: [60.0] * 3},
    )
    healthy = NodeSystem(node_rank=0, cpu_pct=[30.0] * 5, gpu_util_pct={0: [97.0] * 5}, gpu_temp_c={0: [65.0] * 5})
    vs = diagnose(make_run([make_rank(0)], systems=[healthy, node]))
    found = {v.name: v for v in vs if v.scope.get("node_rank") is not None}
    assert set(found) == {"LOW_GPU_UTIL", "GPU_HOT", "HOST_MEM_SATURATED", "HOST_CPU_SATURATED"}
    assert all(v.scope == {"node_rank": 1} for v in found.values())
    assert found["LOW_GPU_UTIL"].evidence["gpu_util_pct"] == {"1": 20.0}


def _status(phase: str, since: float, now: float, done: int = 30) -> RankStatus:
    return RankStatus(ts=now - 1.0, phase=phase, phase_since=since, step=done, steps_done=done, finished=False)


def test_live_hang_names_rank_phase_and_duration() -> None:
    now = 10_000.0
    ranks = []
    for r in range(8):
        st = _status("backward", now - 94.0, now) if r == 5 else _status("wait", now - 93.5, now)
        ranks.append(make_rank(r, node_rank=r // 4, status=st))
    vs = diagnose(make_run(ranks, live=True, now=now))
    v = vs[0]
    assert v.name == "HANG" and v.severity == "critical"
    assert v.scope == {"global_rank": 5, "node_rank": 1}
    assert v.why == "rank 5 (node 1) has been in backward for 94 s; ranks 0-4, 6-7 wait in the all-reduce"
    assert v.evidence["phase"] == "backward" and v.evidence["seconds"] == 94.0
    # The same statuses in a finished run are history, not a hang.
    assert by_name(diagnose(make_run(ranks, live=False, now=now)), "HANG") == []


def test_rank_stalled_while_others_progress_and_all_waiting_hang() -> None:
    now = 10_000.0
    ranks = [make_rank(r, status=_status("forward", now - 0.01, now)) for r in range(3)]
    ranks[2].status = _status("dataloader", now - 120.0, now)
    vs = diagnose(make_run(ranks, parallelism="single", live=True, now=now))
    (v,) = by_name(vs, "RANK_STALLED")
    assert v.scope == {"global_rank": 2} and "dataloader for 120 s" in v.why
    assert by_name(vs, "HANG") == []
    waiting = [make_rank(r, status=_status("wait", now - 200.0, now)) for r in range(3)]
    (h,) = by_name(diagnose(make_run(waiting, live=True, now=now)), "HANG")
    assert h.scope == {} and "no rank is computing" in h.why


def test_silent_rank_is_named() -> None:
    now = 10_000.0
    ranks = [make_rank(r, status=_status("wait", now - 100.0, now)) for r in range(2)]
    ranks[1].status = RankStatus(
        ts=now - 300.0, phase="forward", phase_since=now - 301.0, step=3, steps_done=3, finished=False
    )
    (h,) = by_name(diagnose(make_run(ranks, live=True, now=now)), "HANG")
    assert h.scope["global_rank"] == 1 and "has not reported for 300 s" in h.why


def test_node_views_and_skews() -> None:
    ranks = [make_rank(r, node_rank=r // 2, step_ms=200.0 if r >= 2 else 100.0, wait=None) for r in range(4)]
    views = node_views(make_run(ranks))
    assert [v["node_rank"] for v in views] == [0, 1]
    assert views[1]["ranks"] == [2, 3] and views[1]["step_ms_median"] > 199
    assert views[0]["worst_rank"]["global_rank"] in (0, 1)
    sk = skews(make_run(ranks))
    assert sk["slowest_node"] == 1 and sk["fastest_node"] == 0
    assert abs(sk["node_skew_ms"] - 100) < 1 and abs(sk["node_skew_pct"] - 100) < 1
    assert abs(sk["global_skew_ms"] - 100) < 1


def test_others_median_matches_brute_force() -> None:
    rng = random.Random(7)
    for n in (2, 3, 4, 7, 10):
        values = [rng.choice([1.0, 2.0, 3.0, rng.random()]) for _ in range(n)]
        expect = [median(values[:i] + values[i + 1 :]) for i in range(n)]
        assert others_median(values) == expect


def test_rank_ranges() -> None:
    assert rank_ranges([0, 1, 2, 3, 4, 6, 7]) == "0-4, 6-7"
    assert rank_ranges([5]) == "5" and rank_ranges([]) == ""


def test_format_verdicts_primary_first() -> None:
    now = 10_000.0
    ranks = [make_rank(r, status=_status("wait", now - 100.0, now)) for r in range(2)]
    ranks[1].status = _status("backward", now - 100.0, now)
    ranks[1].phases_ns["backward"] = [v * 2 for v in ranks[1].phases_ns["backward"]]  # type: ignore[operator]
    text = format_verdicts(diagnose(make_run(ranks, live=True, now=now)))
    assert text.startswith("Diagnosis: [CRITICAL] HANG (rank 1)")
    assert "next:" in text and "evidence:" in text and "Also:" in text
    assert format_verdicts([]) == "Diagnosis: no findings."


def test_all_ranks_outside_a_step_is_not_a_hang() -> None:
    now = 10_000.0
    ranks = [make_rank(r, status=_status("idle", now - 300.0, now)) for r in range(4)]
    vs = diagnose(make_run(ranks, live=True, now=now))
    assert by_name(vs, "HANG") == []
    (v,) = by_name(vs, "RANK_STALLED")
    assert v.severity == "info" and "outside a training step" in v.why
