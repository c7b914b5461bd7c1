"""Rollout session records (``agent.session_context``) and the profiler trace files of a run.

A session is stored as rows of ``rollout_sessions`` (one when registered, one
when finalized; the final one wins) and one ``session_phases`` row per phase
execution. Both are read per rank through their ``*_by_group`` index, in
session order, and joined here into ``SessionRecord`` s.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from traceml_daemon.store.read.connect import has_table
from traceml_daemon.store.schema import rank_is

PENDING = "pending"


@dataclass
class PhaseExec:
    start_ts: float | None
    end_ts: float | None  # None: still open when the session was finalized
    start_payload: dict[str, Any] | None = None
    end_payload: dict[str, Any] | None = None

    @property
    def duration_s(self) -> float | None:
        if self.start_ts is None or self.end_ts is None:
            return None
        return max(0.0, self.end_ts - self.start_ts)


@dataclass
class SessionRecord:
    rank: int | None  # the rank's global rank
    rank_id: int
    task_id: int | None
    session_id: int
    status: str
    reason: str | None
    submit_ts: float | None
    finalized_ts: float | None
    open_phases: int | None
    phases: dict[str, list[PhaseExec]] = field(default_factory=dict)

    @property
    def total_s(self) -> float | None:
        if self.submit_ts is None or self.finalized_ts is None:
            return None
        return max(0.0, self.finalized_ts - self.submit_ts)

    def phase_s(self, phase: str) -> float:
        """Time spent in ``phase``: the sum of its executions that ended."""
        return sum(d for d in (e.duration_s for e in self.phases.get(phase, ())) if d is not None)


def _payload(text: str | None) -> dict[str, Any] | None:
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return {"payload": text}
    return value if isinstance(value, dict) else {"payload": value}


def has_sessions(conn: sqlite3.Connection) -> bool:
    return has_table(conn, "rollout_sessions")


def rank_sessions(conn: sqlite3.Connection, rank_id: int, global_rank: int | None,
                  newest: int | None = None) -> list[SessionRecord]:
    """Every session of one rank (``newest``: only its newest that many session rows), by
    session id, with its phase executions."""
    records: dict[int, SessionRecord] = {}
    after = -1
    if newest is not None:
        row = conn.execute(
            f"SELECT session_id FROM rollout_sessions WHERE {rank_is('?1')} ORDER BY session_id DESC LIMIT 1 "
            "OFFSET ?2", (rank_id, newest),
        ).fetchone()
        after = row[0] if row is not None and row[0] is not None else -1
    for task_id, sid, status, reason, submit, final, open_phases in conn.execute(
        "SELECT task_id, session_id, status, reason, submit_ts, finalized_ts, open_phases FROM rollout_sessions "
        f"WHERE {rank_is('?1')} AND session_id > ?2 ORDER BY session_id, rowid",
        (rank_id, after),
    ):
        if sid is None:
            continue
        have = records.get(sid)
        if have is not None and have.status != PENDING and status == PENDING:
            continue  # a final row wins over a registration, whatever their order
        records[sid] = SessionRecord(global_rank, rank_id, task_id, sid, status or PENDING, reason, submit, final,
                                     open_phases)
    for sid, phase, start, end, p0, p1 in conn.execute(
        "SELECT session_id, phase, start_ts, end_ts, start_payload, end_payload FROM session_phases "
        f"WHERE {rank_is('?1')} AND session_id > ?2 ORDER BY session_id, rowid",
        (rank_id, after),
    ):
        rec = records.get(sid)
        if rec is None or phase is None:
            continue  # its session row was dropped on the way (counted by the agent)
        rec.phases.setdefault(phase, []).append(PhaseExec(start, end, _payload(p0), _payload(p1)))
    for rec in records.values():
        for execs in rec.phases.values():
            execs.sort(key=lambda e: (e.start_ts is None, e.start_ts or 0.0))
    return list(records.values())


def run_sessions(conn: sqlite3.Connection, ranks: Iterable[tuple[int, int | None]],
                 newest: int | None = None) -> Iterator[SessionRecord]:
    """The sessions of the ranks given as (rank_id, global_rank), rank by rank (``newest``:
    each rank's newest that many session rows only)."""
    if not has_sessions(conn):
        return
    for rank_id, global_rank in ranks:
        yield from rank_sessions(conn, rank_id, global_rank, newest)


@dataclass(frozen=True)
class ProfileFile:
    rank: int | None
    step: int | None
    steps: int | None
    ts: float | None
    path: str


def run_profiles(conn: sqlite3.Connection, ranks: Iterable[tuple[int, int | None]]) -> list[ProfileFile]:
    """The torch.profiler trace files the ranks wrote, by rank and step."""
    if not has_table(conn, "profiles"):
        return []
    out: list[ProfileFile] = []
    for rank_id, global_rank in ranks:
        for step, steps, ts, path in conn.execute(
            "SELECT step, steps, ts, path FROM profiles WHERE rank_id=? ORDER BY step", (rank_id,)
        ):
            if path:
                out.append(ProfileFile(global_rank, step, steps, ts, path))
    return out


def trainer_wait(conn: sqlite3.Connection, ranks: Iterable[tuple[int, int | None]]) -> tuple[int, float, float]:
    """(steps, seconds in steps outside their dataloader wait, seconds waiting) over the ranks:
    the wait is the steps' dataloader time plus every span of category ``scheduler``
    (where a trainer waits on its rollout queue)."""
    steps, busy, waiting = 0, 0.0, 0.0
    for rank_id, _ in ranks:
        n, step_ns, dl_ns = conn.execute(
            f"SELECT count(*), sum(step_ns), sum(dataloader_ns) FROM steps WHERE {rank_is('?1')}", (rank_id,)
        ).fetchone()
        steps += n or 0
        busy += ((step_ns or 0) - (dl_ns or 0)) / 1e9
        waiting += (dl_ns or 0) / 1e9
        try:
            (span_ns,) = conn.execute(
                f"SELECT sum(dur_ns) FROM spans WHERE {rank_is('?1')} AND category='scheduler' AND dur_ns > 0",
                (rank_id,),
            ).fetchone()
        except sqlite3.OperationalError:  # a database from before schema v9: spans have no category
            span_ns = 0
        waiting += (span_ns or 0) / 1e9
    return steps, max(0.0, busy), waiting


def session_rows(conn: sqlite3.Connection, ranks: Iterable[tuple[int, int | None]]) -> int:
    """Rollout session rows stored for the ranks (registrations and finalizations)."""
    total = 0
    for rank_id, _ in ranks:
        (n,) = conn.execute(f"SELECT count(*) FROM rollout_sessions WHERE {rank_is('?1')}", (rank_id,)).fetchone()
        total += n
    return total
