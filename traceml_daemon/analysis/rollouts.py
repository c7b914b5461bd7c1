"""Verdicts for rollout pipelines (RL: sessions of generate, reward, tool calls ...).

From the figures of ``rollout_stats`` (and, for starvation, the trainer's step
and wait times): a phase with a long tail, a phase that dominates the session,
a high rejection rate and its main reason, sessions pending far beyond the
usual total, and a trainer starved by rollouts. Thresholds: ``RolloutPolicy``.
"""

from __future__ import annotations

from dataclasses import dataclass

from traceml_daemon.analysis.model import Verdict
from traceml_daemon.analysis.policy import Policy
from traceml_daemon.analysis.rollout_stats import TOTAL, RolloutStats, percentile

# Phases that are the session's work by design: their dominance is no finding.
EXPECTED_DOMINANT = ("generate",)


@dataclass(frozen=True)
class TrainerWait:
    """The trainer's time: its steps, and its waits for rollouts (the steps' dataloader
    time and spans of category ``scheduler``), in seconds over the run."""

    step_s: float
    waiting_s: float
    steps: int


def rollout_verdicts(stats: RolloutStats, now: float, policy: Policy,
                     trainer: TrainerWait | None = None) -> list[Verdict]:
    p = policy.rollouts
    out: list[Verdict] = []
    if stats.finalized >= p.min_sessions:
        out += _long_tails(stats, policy)
        out += _dominant(stats, policy)
        rejections = _rejections(stats, policy)
        if rejections is not None:
            out.append(rejections)
    stuck = _stuck(stats, now, policy)
    if stuck is not None:
        out.append(stuck)
    if trainer is not None and stats.sessions:
        starved = _starved(trainer, policy)
        if starved is not None:
            out.append(starved)
    return out


def _long_tails(stats: RolloutStats, policy: Policy) -> list[Verdict]:
    p = policy.rollouts
    out = []
    series = {TOTAL: stats.totals, **stats.phase_times}
    for phase, values in series.items():
        if len(values) < p.min_sessions:
            continue
        data = sorted(values)
        p50, p99 = percentile(data, 0.5), percentile(data, 0.99)
        assert p50 is not None and p99 is not None
        if p99 - p50 < p.tail_min_s or p99 < p.tail_ratio * max(p50, 1e-9):
            continue
        label = "the session total" if phase == TOTAL else f"phase {phase!r}"
        out.append(Verdict(
            name="ROLLOUT_LONG_TAIL",
            severity="warn",
            scope={},
            why=f"{label}: p99 {p99 * 1000:.0f} ms is {p99 / max(p50, 1e-9):.1f}x its p50 {p50 * 1000:.0f} ms "
                f"over {len(data)} sessions: a few slow samples hold the batch back",
            evidence={"phase": phase, "n": len(data), "p50_s": p50, "p99_s": p99, "max_s": data[-1],
                      "ratio": p99 / max(p50, 1e-9)},
            next_step="look at the slowest sessions (`traceml-daemon sessions --jsonl`); cap generation length, "
                      "add a timeout, or over-provision samples and drop the stragglers",
        ))
    return out


def _dominant(stats: RolloutStats, policy: Policy) -> list[Verdict]:
    p = policy.rollouts
    out = []
    expected = list(EXPECTED_DOMINANT)
    for phase, shares in stats.phase_share.items():
        if phase in expected or len(shares) < p.min_sessions:
            continue
        share = percentile(sorted(shares), 0.5)
        if share is None or share < p.dominate_frac:
            continue
        times = sorted(stats.phase_times.get(phase, []))
        out.append(Verdict(
            name="ROLLOUT_PHASE_DOMINATES",
            severity="warn",
            scope={},
            why=f"phase {phase!r} takes {share:.0%} of a session's time (median over {len(shares)} sessions)",
            evidence={"phase": phase, "median_share": share, "n": len(shares),
                      "p50_s": percentile(times, 0.5), "expected_dominant": expected},
            next_step=f"make {phase!r} cheaper or run it concurrently (batch it, move it off the event loop)",
        ))
    return out


def _rejections(stats: RolloutStats, policy: Policy) -> Verdict | None:
    p = policy.rollouts
    accepted = stats.statuses.get("accepted", 0)
    lost = stats.finalized - accepted
    frac = lost / stats.finalized if stats.finalized else 0.0
    if frac < p.reject_frac:
        return None
    reasons = stats.reasons.most_common(p.max_listed)
    main = reasons[0][0] if reasons else "no reason given"
    main_n = reasons[0][1] if reasons else lost
    return Verdict(
        name="ROLLOUT_REJECTIONS_HIGH",
        severity="critical" if frac >= p.reject_critical_frac else "warn",
        scope={},
        why=f"{lost} of {stats.finalized} sessions ({frac:.0%}) were not accepted; main reason: {main} "
            f"({main_n})",
        evidence={"finalized": stats.finalized, "not_accepted": lost, "frac": frac,
                  "statuses": dict(stats.statuses), "reasons": dict(reasons), "main_reason": main},
        next_step="stale samples: raise the allowed staleness or generate closer to the trainer's weights; "
                  "failures: see the reasons",
    )


def _stuck(stats: RolloutStats, now: float, policy: Policy) -> Verdict | None:
    p = policy.rollouts
    if not stats.pending:
        return None
    usual = percentile(sorted(stats.totals), 0.95) if len(stats.totals) >= p.min_sessions else None
    limit = max(p.stuck_min_s, p.stuck_factor * usual) if usual is not None else p.stuck_min_s
    stuck = sorted(((now - ts, rec) for ts, rec in stats.pending if ts and now - ts > limit),
                   key=lambda x: -x[0])
    if not stuck:
        return None
    oldest_age, oldest = stuck[0]
    return Verdict(
        name="ROLLOUT_SESSIONS_STUCK",
        severity="warn",
        scope={} if oldest.rank is None else {"global_rank": oldest.rank},
        why=f"{len(stuck)} sessions pending for more than {limit:.1f} s (the oldest {oldest_age:.1f} s, "
            f"task {oldest.task_id} session {oldest.session_id})"
            + (f"; a usual session takes {usual:.2f} s (p95)" if usual is not None else ""),
        evidence={"stuck": len(stuck), "limit_s": limit, "usual_p95_s": usual,
                  "oldest": [{"rank": r.rank, "task_id": r.task_id, "session_id": r.session_id, "age_s": age,
                              "phases": sorted(r.phases)} for age, r in stuck[: p.max_listed]]},
        next_step="a generate that never returned or a session never finalized: check the inference engine "
                  "and that every path calls mark_finalized",
    )


def _starved(trainer: TrainerWait, policy: Policy) -> Verdict | None:
    p = policy.rollouts
    whole = trainer.step_s + trainer.waiting_s
    if trainer.steps < 2 or whole <= 0:
        return None
    frac = trainer.waiting_s / whole
    if frac < p.starved_frac:
        return None
    return Verdict(
        name="TRAINER_STARVED_BY_ROLLOUTS",
        severity="warn",
        scope={},
        why=f"the trainer waited for rollouts {frac:.0%} of its time ({trainer.waiting_s:.1f} s of "
            f"{whole:.1f} s over {trainer.steps} steps)",
        evidence={"waiting_s": trainer.waiting_s, "step_s": trainer.step_s, "frac": frac, "steps": trainer.steps},
        next_step="more rollout concurrency or inference capacity, or train asynchronously on slightly stale samples",
    )
