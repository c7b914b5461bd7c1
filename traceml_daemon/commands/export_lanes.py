"""Chrome trace rows for spans by lane and for rollout sessions, packed into few rows.

A viewer needs the slices of one row to nest strictly. Spans of one lane (a
thread, an asyncio task) nest by construction; hundreds of short-lived tasks
would make hundreds of rows, so tasks whose lifetimes do not overlap share a
row. Each rollout session is a slice holding its phase executions; sessions
that do not overlap in time share a row (greedy interval partitioning: the
fewest rows the overlap allows).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import Any

from traceml_daemon.store.read.rollouts import SessionRecord

TID_LANES = 100  # first row of span lanes (threads and packed tasks)
TID_SESSIONS = 10_000  # first row of session rows


def pack(intervals: Iterable[tuple[float, float, Any]]) -> list[tuple[int, Any]]:
    """(row, key) for each (start, end, key): rows are reused once their last interval ended."""
    free: list[int] = []
    busy: list[tuple[float, int]] = []  # (end, row)
    rows = 0
    out = []
    for start, end, key in sorted(intervals, key=lambda x: (x[0], -x[1])):
        while busy and busy[0][0] <= start:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            row = heapq.heappop(free)
        else:
            row = rows
            rows += 1
        heapq.heappush(busy, (end, row))
        out.append((row, key))
    return out


def span_rows(lanes: dict[str | None, tuple[float, float]]) -> tuple[dict[str | None, int], dict[int, str]]:
    """Rows for span lanes given each lane's (first start, last end) in trace time:
    (lane -> tid, tid -> row name). Threads (and spans without a lane) get a row each;
    tasks are packed."""
    tids: dict[str | None, int] = {}
    names: dict[int, str] = {}
    next_tid = TID_LANES
    for lane in sorted((x for x in lanes if x is None or not x.startswith("task:")), key=lambda x: x or ""):
        tids[lane] = next_tid
        names[next_tid] = "spans" if lane is None else f"spans {lane}"
        next_tid += 1
    tasks = [(b[0], b[1], lane) for lane, b in lanes.items() if lane is not None and lane.startswith("task:")]
    for row, lane in pack(tasks):
        tid = next_tid + row
        tids[lane] = tid
        names[tid] = f"tasks {row + 1}"
    return tids, names


def session_events(sessions: list[SessionRecord], pid: int, base: float, end_of_data: float,
                   window: tuple[float, float] | None = None) -> tuple[list[dict[str, Any]], dict[int, str]]:
    """A slice per session holding its phases, sessions packed into rows; (events, tid -> row name).

    Times: wall seconds; ``base`` is the trace's zero, ``end_of_data`` closes sessions
    still pending and phases left open. ``window`` (trace microseconds) keeps the sessions
    that overlap it."""
    spans = []
    for rec in sessions:
        if rec.submit_ts is None:
            continue
        ends = [e.end_ts or e.start_ts for execs in rec.phases.values() for e in execs if (e.end_ts or e.start_ts)]
        end = rec.finalized_ts if rec.finalized_ts is not None else max([end_of_data, *ends])
        start_us, end_us = (rec.submit_ts - base) * 1e6, (max(end, rec.submit_ts) - base) * 1e6
        if window is not None and (end_us < window[0] or start_us > window[1]):
            continue
        spans.append((start_us, end_us, rec))
    events: list[dict[str, Any]] = []
    names: dict[int, str] = {}
    for row, rec in pack(spans):
        tid = TID_SESSIONS + row
        names[tid] = f"sessions {row + 1}"
        start_us = (rec.submit_ts - base) * 1e6  # type: ignore[operator]
        close = rec.finalized_ts if rec.finalized_ts is not None else end_of_data
        end_us = max(start_us, (close - base) * 1e6)
        args: dict[str, Any] = {"task_id": rec.task_id, "session_id": rec.session_id, "status": rec.status,
                                "total_s": rec.total_s}
        if rec.reason:
            args["reason"] = rec.reason
        events.append({"name": f"session {rec.session_id} ({rec.status})", "cat": "session", "ph": "X", "pid": pid,
                       "tid": tid, "ts": start_us, "dur": end_us - start_us, "args": args})
        for phase, execs in rec.phases.items():
            for e in execs:
                if e.start_ts is None:
                    continue
                p_start = min(max((e.start_ts - base) * 1e6, start_us), end_us)
                p_end = end_us if e.end_ts is None else min(max((e.end_ts - base) * 1e6, p_start), end_us)
                p_args: dict[str, Any] = {"session_id": rec.session_id, "task_id": rec.task_id}
                if e.end_ts is None:
                    p_args["ended"] = False
                if e.start_payload:
                    p_args["start"] = e.start_payload
                if e.end_payload:
                    p_args["end"] = e.end_payload
                events.append({"name": phase, "cat": "session_phase", "ph": "X", "pid": pid, "tid": tid,
                               "ts": p_start, "dur": p_end - p_start, "args": p_args})
    return events, names
