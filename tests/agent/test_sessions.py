"""Rollout tasks and sessions: registration per call, phases, finalization, bounds."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest

import agent
from agent import sessions
from agent.errors import ErrorReporter


@pytest.fixture
def book(monkeypatch: pytest.MonkeyPatch) -> Iterator[sessions.SessionBook]:
    b = sessions.SessionBook(1 << 20, ErrorReporter())
    monkeypatch.setattr(sessions, "resolve_book", lambda: b)
    yield b


def tables(book: sessions.SessionBook) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for name, cols in book.take().items():
        out[name] = [dict(zip(cols, vals, strict=True)) for vals in zip(*cols.values(), strict=True)]
    return out


def test_concurrent_sessions_phases_and_statuses(book: sessions.SessionBook) -> None:
    @agent.trace_session("reward")
    async def reward(i: int) -> float:
        await asyncio.sleep(0.001)
        return float(i)

    @agent.session_context()
    async def collect(i: int) -> int:
        sid = agent.current_session_id()
        async with agent.trace_session_phase("generate", start_payload={"i": i}, end_payload={"tokens": 3}):
            await asyncio.sleep(0.01)
        await reward(i)
        if i % 3 == 0:
            with agent.trace_session_phase("toolcall"):
                pass
        status = "rejected" if i % 2 else "accepted"
        agent.trace_session_event("mark_finalized", session_id=sid, status=status,
                                  reason="stale_weight" if i % 2 else None)
        assert sid is not None
        return sid

    async def episode() -> tuple[int, list[int]]:
        task = agent.set_task_id()
        return task, list(await asyncio.gather(*(collect(i) for i in range(4))))

    async def main() -> list[tuple[int, list[int]]]:
        return list(await asyncio.gather(episode(), episode()))

    results = asyncio.run(main())
    out = tables(book)
    recs = {r["session_id"]: r for r in out["rollout_sessions"]}
    assert len(recs) == 8 and len(out["rollout_sessions"]) == 8  # pending rows folded into final ones
    for task, sids in results:
        assert len(set(sids)) == 4 and all(recs[s]["task_id"] == task for s in sids)
    assert results[0][0] != results[1][0]
    assert sorted(r["status"] for r in recs.values()) == ["accepted"] * 4 + ["rejected"] * 4
    assert all(r["reason"] == "stale_weight" for r in recs.values() if r["status"] == "rejected")
    phases = out["session_phases"]
    assert sorted(p["phase"] for p in phases if p["session_id"] == 1) in (["generate", "reward", "toolcall"],
                                                                          ["generate", "reward"])
    gen = [p for p in phases if p["phase"] == "generate"]
    assert len(gen) == 8 and all(json.loads(p["end_payload"]) == {"tokens": 3} for p in gen)
    for p in phases:
        rec = recs[p["session_id"]]
        assert rec["submit_ts"] <= p["start_ts"] <= p["end_ts"] <= rec["finalized_ts"]
    assert sum(p["phase"] == "toolcall" for p in phases) == 4  # i = 0 and 3 of each task


def test_pending_sessions_are_sent_then_finalized(book: sessions.SessionBook) -> None:
    @agent.session_context()
    def start() -> int | None:
        return agent.current_session_id()

    agent.set_task_id(41)
    sid = start()
    first = tables(book)["rollout_sessions"]
    assert [(r["session_id"], r["status"], r["task_id"], r["finalized_ts"]) for r in first] == [
        (sid, "pending", 41, None)]
    agent.trace_session_event("mark_finalized", session_id=sid, status="failed", reason="engine error")
    second = tables(book)["rollout_sessions"]
    assert [(r["status"], r["reason"]) for r in second] == [("failed", "engine error")]


def test_finalizing_a_task_finalizes_its_sessions_and_closes_open_phases(book: sessions.SessionBook) -> None:
    entered = asyncio.Event

    @agent.session_context()
    async def collect(gate: asyncio.Event, started: list[int]) -> None:
        async with agent.trace_session_phase("generate"):
            started.append(1)
            await gate.wait()  # still generating when the task is finalized

    async def main() -> None:
        gate: asyncio.Event = entered()
        started: list[int] = []
        task = agent.set_task_id()
        runs = [asyncio.create_task(collect(gate, started)) for _ in range(3)]
        while len(started) < 3:
            await asyncio.sleep(0)
        agent.trace_session_event("mark_finalized", task_id=task, status="dropped", reason="timeout")
        gate.set()
        await asyncio.gather(*runs)

    asyncio.run(main())
    out = tables(book)
    recs = out["rollout_sessions"]
    assert [(r["status"], r["reason"], r["open_phases"]) for r in recs] == [("dropped", "timeout", 1)] * 3
    assert [(p["phase"], p["end_ts"]) for p in out["session_phases"]] == [("generate", None)] * 3
    assert book.counters()["session_phases_unended"] == 3


def test_mark_events_and_unknown_ones(book: sessions.SessionBook) -> None:
    @agent.session_context()
    def run() -> None:
        agent.trace_session_event("mark_verify_start", note="x")
        agent.trace_session_event("mark_verify_end")
        agent.trace_session_event("no_such_event")
        agent.trace_session_event("mark_finalized")

    run()
    out = tables(book)
    assert [(p["phase"], json.loads(p["start_payload"])) for p in out["session_phases"]] == [("verify", {"note": "x"})]
    assert out["rollout_sessions"][0]["status"] == "accepted"
    assert book.reporter.counts.get("session:event") == 1


def test_open_sessions_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    b = sessions.SessionBook(1 << 20, ErrorReporter(), max_open=10)
    monkeypatch.setattr(sessions, "resolve_book", lambda: b)

    @agent.session_context()
    def start() -> None:
        with agent.trace_session_phase("generate"):
            pass

    for _ in range(15):
        start()
    assert b.counters()["sessions_untracked"] == 5
    assert b.counters()["session_phases_orphaned"] == 5
    assert len(tables(b)["rollout_sessions"]) == 10


def test_phase_outside_a_session_runs_and_is_counted(book: sessions.SessionBook) -> None:
    with agent.trace_session_phase("generate"):
        pass
    assert book.counters()["session_phases_orphaned"] == 1 and book.take() == {}
