"""The recorder's byte cap: it holds at most its bound, drops the oldest rows
first, and counts every row it drops (in-process and through a real agent)."""

from __future__ import annotations

from typing import Any

from agent.recorder import _ROW_BYTES, Recorder
from tests.agent.fake_relay import FakeRelay
from tests.agent.procs import run
from tests.agent.test_runtime import STEPS, tables_of

STEP_ROW = _ROW_BYTES["steps"]


def _step(i: int) -> dict[str, Any]:
    return {"step": i, "ts": float(i), "step_ns": 1000 + i}


def test_full_recorder_keeps_the_newest_rows_within_its_bound_and_counts_the_rest() -> None:
    rec = Recorder(max_bytes=10 * STEP_ROW)
    for i in range(25):
        rec.add("steps", _step(i))
        assert rec.statistics()["buffered_bytes"] <= rec.max_bytes
    drained = rec.drain()["steps"]["step"]
    assert drained == list(range(15, 25))
    assert rec.rows_dropped == 15 and rec.dropped_by_table["steps"] == 15
    assert len(drained) + rec.rows_dropped == 25
    assert rec.statistics()["buffered_bytes"] == 0


def test_a_table_with_nothing_to_give_up_drops_its_new_row_and_counts_it() -> None:
    rec = Recorder(max_bytes=3 * STEP_ROW)
    for i in range(3):
        rec.add("steps", _step(i))
    rec.add("drops", {"ts": 1.0, "source": "x", "count": 1})  # room only by dropping its own (none)
    assert rec.dropped_by_table["drops"] == 1 and rec.rows_dropped == 1
    assert rec.drain()["steps"]["step"] == [0, 1, 2]


def test_real_agent_with_a_tiny_recorder_sends_newest_steps_and_reports_the_drops(make_relay: Any) -> None:
    relay: FakeRelay = make_relay()
    steps, cap = 300, 40 * STEP_ROW
    # One flush at shutdown: every step waits in the recorder, far more than its cap holds.
    code = "import agent\nagent.init()\n" + STEPS.format(n=steps) + "agent.shutdown()\n"
    done = run(code, TRACEML_RELAY_PORT=str(relay.port), TRACEML_RECORDER_BYTES=str(cap), TRACEML_FLUSH_S="600")
    assert done.returncode == 0, done.stderr
    rows = tables_of(relay)
    got = [r["step"] for r in rows["steps"]]
    assert 0 < len(got) <= cap // STEP_ROW
    assert got == list(range(steps - len(got), steps))  # the oldest went first
    reported = max(r["count"] for r in rows["drops"] if r["source"] == "recorder_rows")
    assert reported >= steps - len(got)
