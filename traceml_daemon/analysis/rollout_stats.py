"""Figures of a run's rollout sessions: rates, statuses, phase percentiles, acceptance, reasons.

Input: ``store.read.rollouts.SessionRecord`` s (any iterable); output plain
dicts, the same for the ``sessions`` command's text and JSON, the TUI's
rollouts screen and the rollout verdicts. No I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

PENDING = "pending"
TOTAL = "total"  # the key of submit-to-finalize time among the phase figures
OLDEST_PENDING = 10  # pending sessions listed, oldest first


class PhaseLike(Protocol):
    @property
    def duration_s(self) -> float | None: ...


class SessionLike(Protocol):
    rank: int | None
    task_id: int | None
    session_id: int
    status: str
    reason: str | None
    submit_ts: float | None
    finalized_ts: float | None
    open_phases: int | None
    phases: dict[str, list[Any]]

    @property
    def total_s(self) -> float | None: ...

    def phase_s(self, phase: str) -> float: ...


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by linear interpolation; None for no values."""
    if not sorted_values:
        return None
    pos = (len(sorted_values) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def distribution(values: Iterable[float]) -> dict[str, Any]:
    data = sorted(values)
    return {
        "n": len(data),
        "p50_s": percentile(data, 0.50),
        "p95_s": percentile(data, 0.95),
        "p99_s": percentile(data, 0.99),
        "max_s": data[-1] if data else None,
        "mean_s": sum(data) / len(data) if data else None,
    }


@dataclass
class RolloutStats:
    sessions: int = 0
    finalized: int = 0
    first_submit: float | None = None
    last_finalize: float | None = None
    statuses: Counter[str] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)  # rejection / failure / drop reasons
    phase_times: dict[str, list[float]] = field(default_factory=dict)  # finalized sessions: per-session sum
    phase_share: dict[str, list[float]] = field(default_factory=dict)  # phase_s / total_s
    totals: list[float] = field(default_factory=list)
    tasks: dict[Any, list[int]] = field(default_factory=dict)  # task -> [sessions finalized, accepted]
    pending: list[tuple[float, Any]] = field(default_factory=list)  # (submit_ts, record)
    open_phases: int = 0

    def add(self, rec: SessionLike) -> None:
        self.sessions += 1
        self.statuses[rec.status] += 1
        if rec.submit_ts is not None and (self.first_submit is None or rec.submit_ts < self.first_submit):
            self.first_submit = rec.submit_ts
        if rec.status == PENDING:
            self.pending.append((rec.submit_ts or 0.0, rec))
            return
        self.finalized += 1
        self.open_phases += rec.open_phases or 0
        if rec.finalized_ts is not None and (self.last_finalize is None or rec.finalized_ts > self.last_finalize):
            self.last_finalize = rec.finalized_ts
        if rec.status != "accepted" and rec.reason:
            self.reasons[f"{rec.status}: {rec.reason}"] += 1
        task = self.tasks.setdefault((rec.rank, rec.task_id), [0, 0])
        task[0] += 1
        task[1] += rec.status == "accepted"
        total = rec.total_s
        if total is not None:
            self.totals.append(total)
        for phase in rec.phases:
            spent = rec.phase_s(phase)
            self.phase_times.setdefault(phase, []).append(spent)
            if total:
                self.phase_share.setdefault(phase, []).append(spent / total)


def collect(records: Iterable[SessionLike]) -> RolloutStats:
    stats = RolloutStats()
    for rec in records:
        stats.add(rec)
    return stats


def summarize(stats: RolloutStats, now: float, oldest: int = OLDEST_PENDING) -> dict[str, Any]:
    """The summary as JSON-able dict (``now``: wall clock, for the pending sessions' age)."""
    span = None
    if stats.first_submit is not None and stats.last_finalize is not None:
        span = max(0.0, stats.last_finalize - stats.first_submit)
    phases = {TOTAL: distribution(stats.totals)}
    for phase, times in sorted(stats.phase_times.items()):
        phases[phase] = distribution(times)
        shares = stats.phase_share.get(phase, [])
        phases[phase]["share_of_total_median"] = percentile(sorted(shares), 0.5)
    rates = [acc / n for n, acc in stats.tasks.values() if n]
    rejected = sum(n for s, n in stats.statuses.items() if s not in ("accepted", PENDING))
    pending = sorted(stats.pending, key=lambda p: p[0])[:oldest]
    return {
        "sessions": stats.sessions,
        "finalized": stats.finalized,
        "pending": stats.statuses.get(PENDING, 0),
        "sessions_per_s": stats.finalized / span if span else None,
        "window_s": span,
        "statuses": dict(stats.statuses.most_common()),
        "not_accepted_frac": rejected / stats.finalized if stats.finalized else None,
        "reasons": dict(stats.reasons.most_common()),
        "phases": phases,
        "tasks": {
            "tasks": len(stats.tasks),
            "acceptance_mean": sum(rates) / len(rates) if rates else None,
            "all_accepted": sum(1 for r in rates if r == 1.0),
            "none_accepted": sum(1 for r in rates if r == 0.0),
        },
        "phases_left_open": stats.open_phases,
        "oldest_pending": [
            {"rank": rec.rank, "task_id": rec.task_id, "session_id": rec.session_id,
             "age_s": None if rec.submit_ts is None else max(0.0, now - rec.submit_ts),
             "phases": sorted(rec.phases)}
            for _, rec in pending
        ],
    }


def areal_record(rec: SessionLike) -> dict[str, Any]:
    """One session in AReaL's JSONL field layout, plus reason and open_phases."""
    out: dict[str, Any] = {
        "task_id": rec.task_id,
        "session_id": rec.session_id,
        "rank": rec.rank,
        "status": rec.status,
        "reason": rec.reason,
        "submit_ts": rec.submit_ts,
        "finalized_ts": rec.finalized_ts,
        "total_s": rec.total_s,
    }
    for phase in sorted(rec.phases):
        out[f"{phase}_s"] = rec.phase_s(phase)
    out["phases"] = {
        phase: [
            {"start_ts": e.start_ts, "end_ts": e.end_ts,
             **({"start_payload": e.start_payload} if e.start_payload else {}),
             **({"end_payload": e.end_payload} if e.end_payload else {})}
            for e in execs
        ]
        for phase, execs in sorted(rec.phases.items())
    }
    if rec.open_phases:
        out["open_phases"] = rec.open_phases
    return out
