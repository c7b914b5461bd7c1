"""Rollout figures and verdicts from session records: each verdict fires past its threshold
and stays quiet under it (thresholds from RolloutPolicy)."""

from __future__ import annotations

from dataclasses import replace

from traceml_daemon.analysis.policy import DEFAULT_POLICY, RolloutPolicy
from traceml_daemon.analysis.rollout_stats import areal_record, collect, summarize
from traceml_daemon.analysis.rollouts import TrainerWait, rollout_verdicts
from traceml_daemon.store.read.rollouts import PhaseExec, SessionRecord

NOW = 1_000_000.0


def session(sid: int, phases: dict[str, float], status: str = "accepted", reason: str | None = None,
            task: int = 1, submit: float = NOW - 500, pending: bool = False) -> SessionRecord:
    t = submit
    execs: dict[str, list[PhaseExec]] = {}
    for phase, dur in phases.items():
        execs.setdefault(phase, []).append(PhaseExec(t, t + dur))
        t += dur
    return SessionRecord(0, 1, task, sid, "pending" if pending else status, reason, submit,
                         None if pending else t, 0, execs)


def names(records: list[SessionRecord], trainer: TrainerWait | None = None, **policy: float) -> set[str]:
    pol = replace(DEFAULT_POLICY, rollouts=replace(RolloutPolicy(), **policy))
    return {v.name for v in rollout_verdicts(collect(records), NOW, pol, trainer)}


def test_healthy_sessions_raise_nothing() -> None:
    records = [session(i, {"generate": 0.10 + 0.001 * (i % 5), "reward": 0.01}) for i in range(50)]
    assert names(records, TrainerWait(step_s=10.0, waiting_s=1.0, steps=20)) == set()


def test_long_tail_of_a_phase() -> None:
    records = [session(i, {"generate": 2.0 if i % 25 == 0 else 0.05}) for i in range(100)]
    assert "ROLLOUT_LONG_TAIL" in names(records)
    assert "ROLLOUT_LONG_TAIL" not in names(records, tail_ratio=100.0)
    assert "ROLLOUT_LONG_TAIL" not in names(records[:10])  # too few sessions


def test_a_phase_dominating_the_session_but_not_generate() -> None:
    slow_reward = [session(i, {"generate": 0.1, "reward": 0.4}) for i in range(30)]
    assert "ROLLOUT_PHASE_DOMINATES" in names(slow_reward)
    slow_generate = [session(i, {"generate": 0.4, "reward": 0.1}) for i in range(30)]
    assert "ROLLOUT_PHASE_DOMINATES" not in names(slow_generate)


def test_rejections_name_the_main_reason() -> None:
    records = [session(i, {"generate": 0.1}, *(("rejected", "stale_weight") if i % 2 else ("accepted", None)))
               for i in range(40)]
    records += [session(100 + i, {"generate": 0.1}, "failed", "engine_error") for i in range(3)]
    pol = replace(DEFAULT_POLICY, rollouts=RolloutPolicy())
    verdict = next(v for v in rollout_verdicts(collect(records), NOW, pol) if v.name == "ROLLOUT_REJECTIONS_HIGH")
    assert verdict.evidence["main_reason"] == "rejected: stale_weight" and verdict.severity == "warn"
    assert "ROLLOUT_REJECTIONS_HIGH" not in names(records, reject_frac=0.9)


def test_stuck_pending_sessions() -> None:
    records = [session(i, {"generate": 0.1}) for i in range(30)]
    records.append(session(99, {}, pending=True, submit=NOW - 60))  # 60 s against a 0.1 s usual total
    records.append(session(98, {}, pending=True, submit=NOW - 1))  # young: not stuck
    verdicts = rollout_verdicts(collect(records), NOW, DEFAULT_POLICY)
    stuck = next(v for v in verdicts if v.name == "ROLLOUT_SESSIONS_STUCK")
    assert [s["session_id"] for s in stuck.evidence["oldest"]] == [99]
    assert "ROLLOUT_SESSIONS_STUCK" not in names(records, stuck_min_s=120.0)


def test_trainer_starved() -> None:
    records = [session(i, {"generate": 0.1}) for i in range(30)]
    assert "TRAINER_STARVED_BY_ROLLOUTS" in names(records, TrainerWait(step_s=2.0, waiting_s=3.0, steps=20))
    assert "TRAINER_STARVED_BY_ROLLOUTS" not in names(records, TrainerWait(step_s=9.0, waiting_s=1.0, steps=20))


def test_summary_and_areal_layout() -> None:
    records = [session(i, {"generate": 0.1 * (i + 1), "reward": 0.01}, task=i // 2) for i in range(4)]
    records.append(session(9, {}, pending=True, submit=NOW - 5))
    s = summarize(collect(records), NOW)
    assert s["sessions"] == 5 and s["finalized"] == 4 and s["pending"] == 1
    assert s["phases"]["generate"]["n"] == 4 and abs(s["phases"]["generate"]["p50_s"] - 0.25) < 1e-9
    assert s["oldest_pending"][0]["session_id"] == 9 and abs(s["oldest_pending"][0]["age_s"] - 5) < 1e-9
    assert s["tasks"]["tasks"] == 2 and s["tasks"]["acceptance_mean"] == 1.0
    rec = areal_record(records[1])
    assert list(rec)[:8] == ["task_id", "session_id", "rank", "status", "reason", "submit_ts", "finalized_ts",
                             "total_s"]
    assert abs(rec["generate_s"] - 0.2) < 1e-9 and abs(rec["total_s"] - 0.21) < 1e-9
    assert rec["phases"]["reward"][0]["end_ts"] - rec["phases"]["reward"][0]["start_ts"] > 0
