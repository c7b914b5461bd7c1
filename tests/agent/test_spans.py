"""agent.span / trace_perf / instant: with, async with, decorators; nesting per asyncio task and thread."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import agent
from agent import spans
from agent.errors import ErrorReporter


@pytest.fixture
def sink(monkeypatch: pytest.MonkeyPatch) -> Iterator[spans.SpanSink]:
    s = spans.SpanSink(1 << 20, ErrorReporter())
    monkeypatch.setattr(spans, "resolve_sink", lambda: s)
    yield s


def rows(sink: spans.SpanSink) -> list[dict[str, Any]]:
    cols = sink.take() or {}
    return [dict(zip(cols, vals, strict=True)) for vals in zip(*cols.values(), strict=True)]


def test_with_span_category_args_and_nesting(sink: spans.SpanSink) -> None:
    with agent.span("outer", category="compute", global_step=3):
        with agent.span("inner"):
            agent.instant("mark", category="scheduler", size=2)
    out = {r["name"]: r for r in rows(sink)}
    assert out["outer"]["category"] == "compute" and json.loads(out["outer"]["args"]) == {"global_step": 3}
    assert out["inner"]["parent_id"] == out["outer"]["span_id"] and out["outer"]["parent_id"] is None
    assert out["mark"]["parent_id"] == out["inner"]["span_id"] and out["mark"]["dur_ns"] is None
    assert out["outer"]["lane"] == "thread:MainThread"
    assert out["outer"]["start_ns"] <= out["inner"]["start_ns"]
    assert out["inner"]["start_ns"] + out["inner"]["dur_ns"] <= out["outer"]["start_ns"] + out["outer"]["dur_ns"]


def test_concurrent_tasks_nest_by_task_never_across(sink: spans.SpanSink) -> None:
    @agent.trace_perf("work", category="compute")
    async def work(i: int) -> int:
        async with agent.span("step", i=i):
            await asyncio.sleep(0.01)  # every task is inside its span at once
        return i

    async def main() -> list[int]:
        async with agent.span("outer"):
            return list(await asyncio.gather(*(work(i) for i in range(5))))

    assert asyncio.run(main()) == [0, 1, 2, 3, 4]
    out = rows(sink)
    works = {r["span_id"]: r for r in out if r["name"] == "work"}
    steps = [r for r in out if r["name"] == "step"]
    assert len(works) == 5 and len(steps) == 5
    assert all(w["parent_id"] is None for w in works.values())  # the outer span is another task's
    for s in steps:
        parent = works[s["parent_id"]]
        assert parent["lane"] == s["lane"] and s["lane"].startswith("task:")
    assert len({s["lane"] for s in steps}) == 5


def test_threads_land_on_their_own_lane(sink: spans.SpanSink) -> None:
    def body() -> None:
        with agent.span("t-outer"), agent.span("t-inner"):
            pass

    with agent.span("main"):
        t = threading.Thread(target=body, name="loader-1")
        t.start()
        t.join()
    out = {r["name"]: r for r in rows(sink)}
    assert out["t-outer"]["lane"] == "thread:loader-1" and out["t-outer"]["parent_id"] is None
    assert out["t-inner"]["parent_id"] == out["t-outer"]["span_id"]


def test_exception_recorded_and_reraised_unchanged(sink: spans.SpanSink) -> None:
    err = KeyError("k")

    @agent.trace_perf("sync-fn")
    def fails() -> None:
        raise err

    @agent.span("async-fn", category="io")
    async def afails() -> None:
        raise ValueError("bad")

    with pytest.raises(KeyError) as got:
        fails()
    assert got.value is err
    with pytest.raises(ValueError, match="bad"):
        asyncio.run(afails())
    out = {r["name"]: r for r in rows(sink)}
    assert json.loads(out["sync-fn"]["args"])["exception"].startswith("KeyError")
    assert json.loads(out["async-fn"]["args"])["exception"] == "ValueError: bad"
    assert out["async-fn"]["category"] == "io"


def test_decorated_functions_keep_their_results_and_names(sink: spans.SpanSink) -> None:
    @agent.trace_perf("add")
    def add(a: int, b: int) -> int:
        return a + b

    @agent.span("twice")
    async def twice(x: int) -> int:
        return 2 * x

    assert add(2, 3) == 5 and add.__name__ == "add"
    assert asyncio.run(twice(4)) == 8
    assert sorted(r["name"] for r in rows(sink)) == ["add", "twice"]


def test_buffer_is_bounded_and_counts_drops(monkeypatch: pytest.MonkeyPatch) -> None:
    s = spans.SpanSink(0, ErrorReporter())  # the floor: 1024 rows
    monkeypatch.setattr(spans, "resolve_sink", lambda: s)
    for _ in range(1500):
        with agent.span("x"):
            pass
    assert s.dropped == 1500 - s.max_rows
    assert len(rows(s)) == s.max_rows


def test_agent_off_spans_still_run_the_code(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spans, "resolve_sink", lambda: None)

    @agent.trace_perf("f")
    async def f() -> int:
        async with agent.span("s"):
            return 1

    with agent.span("x"):
        pass
    agent.instant("y")
    assert asyncio.run(f()) == 1
