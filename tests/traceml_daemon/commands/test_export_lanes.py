"""Chrome trace rows: intervals packed into the fewest rows the overlap allows, threads a
row each, a session's phases inside its slice (an open phase drawn to the session's end)."""

from __future__ import annotations

from traceml_daemon.commands.export_lanes import TID_LANES, TID_SESSIONS, pack, session_events, span_rows
from traceml_daemon.store.read.rollouts import PhaseExec, SessionRecord


def test_pack_uses_as_many_rows_as_the_deepest_overlap() -> None:
    intervals = [(0, 10, "a"), (2, 4, "b"), (5, 12, "c"), (11, 13, "d"), (12, 20, "e"), (3, 6, "f")]
    placed = dict((key, row) for row, key in pack(intervals))
    assert max(placed.values()) + 1 == 3  # at t=3: a, b and f overlap
    by_row: dict[int, list[tuple[int, int]]] = {}
    for start, end, key in intervals:
        by_row.setdefault(placed[key], []).append((start, end))
    for spans in by_row.values():  # no two intervals of a row overlap
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))


def test_span_rows_threads_alone_tasks_packed() -> None:
    tids, names = span_rows({"thread:MainThread": (0.0, 100.0), "thread:loader": (0.0, 5.0),
                             "task:Task-1": (0.0, 10.0), "task:Task-2": (10.0, 20.0), "task:Task-3": (5.0, 15.0)})
    assert tids["thread:MainThread"] != tids["thread:loader"]
    assert tids["task:Task-1"] == tids["task:Task-2"] != tids["task:Task-3"]  # 1 and 2 do not overlap
    assert {names[tids["task:Task-1"]], names[tids["task:Task-3"]]} == {"tasks 1", "tasks 2"}
    assert min(tids.values()) >= TID_LANES


def test_session_slices_hold_their_phases() -> None:
    base = 1000.0
    done = SessionRecord(0, 1, 7, 1, "accepted", None, base + 1, base + 3, 0,
                         {"generate": [PhaseExec(base + 1, base + 2)], "reward": [PhaseExec(base + 2, base + 2.5)]})
    dropped = SessionRecord(0, 1, 7, 2, "dropped", "timeout", base + 1.5, base + 4, 1,
                            {"generate": [PhaseExec(base + 1.6, None)]})
    later = SessionRecord(0, 1, 8, 3, "accepted", None, base + 3.5, base + 5, 0, {})
    events, names = session_events([done, dropped, later], pid=1, base=base, end_of_data=base + 6)
    slices = {e["args"]["session_id"]: e for e in events if e["cat"] == "session"}
    assert slices[1]["tid"] != slices[2]["tid"] and slices[3]["tid"] == slices[1]["tid"]  # reused after 1 ended
    assert set(names) == {TID_SESSIONS, TID_SESSIONS + 1}
    assert slices[2]["args"]["reason"] == "timeout" and slices[2]["dur"] == 2.5e6
    open_phase = next(e for e in events if e["cat"] == "session_phase" and e["args"]["session_id"] == 2)
    assert open_phase["args"]["ended"] is False
    assert open_phase["ts"] + open_phase["dur"] == slices[2]["ts"] + slices[2]["dur"]  # drawn to the session's end
    for e in events:
        if e["cat"] == "session_phase":
            s = slices[e["args"]["session_id"]]
            assert s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] and e["tid"] == s["tid"]
