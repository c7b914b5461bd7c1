"""``traceml-daemon export``: Chrome trace (Perfetto) and CSV from a stored run."""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from traceml_daemon.commands import export
from traceml_daemon.store.migrations import MIGRATIONS
from traceml_daemon.store.schema import SCHEMA_VERSION
from traceml_wire.tables import PHASES

BASE_TS = 1_700_000_000.0
STEP_NS = 10_000_000  # 10 ms per step
PHASE_NS = {"dataloader": 1_000_000, "h2d": None, "forward": 3_000_000, "backward": 4_000_000,
            "optimizer": 1_000_000, "wait": 500_000}
# (global_rank, local_rank, node_rank, hostname): two nodes x two ranks, inserted out of order.
RANKS = [(3, 1, 1, "b"), (0, 0, 0, "a"), (2, 0, 1, "b"), (1, 1, 0, "a")]
N_STEPS = 5


def make_db(path: Path, ranks: list[tuple[int, int, int, str]] = RANKS, steps: int = N_STEPS,
            session: str = "job-1", attempt: int = 0) -> Path:
    con = sqlite3.connect(path)
    for statement in MIGRATIONS[0]:
        con.execute(statement)
    con.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
    add_run(con, ranks, steps, session, attempt)
    con.commit()
    con.close()
    return path


def add_run(con: sqlite3.Connection, ranks: list[tuple[int, int, int, str]], steps: int, session: str,
            attempt: int) -> None:
    for g, local, node, host in ranks:
        cur = con.execute(
            "INSERT INTO ranks (sender, session, attempt, global_rank, local_rank, node_rank, hostname, world_size)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (f"{session}/a{attempt}/n{node}/r{g}/1-x", session, attempt, g, local, node, host, len(ranks)))
        rank_id = cur.lastrowid
        for s in range(steps):
            ts = BASE_TS + (s + 1) * STEP_NS / 1e9
            con.execute(
                "INSERT INTO steps (rank_id, step, ts, step_ns, dataloader_ns, h2d_ns, forward_ns, backward_ns,"
                " optimizer_ns, wait_ns, peak_bytes, rss_bytes) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                (rank_id, s, ts, STEP_NS, *(PHASE_NS[p] for p in PHASES), None, 1000 + s))
        # A span tagged with step 1, an untagged span during step 3, an instant in step 2.
        con.execute("INSERT INTO spans (rank_id, name, start_ns, dur_ns, step, args) VALUES (?, 'fetch', ?, ?, 1, ?)",
                    (rank_id, int((BASE_TS + 0.011) * 1e9), 2_000_000, json.dumps({"shard": g})))
        con.execute("INSERT INTO spans (rank_id, name, start_ns, dur_ns, step, args) VALUES (?, 'eval', ?, ?, NULL, NULL)",
                    (rank_id, int((BASE_TS + 0.032) * 1e9), 3_000_000))
        con.execute("INSERT INTO spans (rank_id, name, start_ns, dur_ns, step, args) VALUES (?, 'checkpoint', ?, NULL, 2, 'not json')",
                    (rank_id, int((BASE_TS + 0.025) * 1e9)))


def run_export(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    export.add_arguments(parser)
    return export.main(parser.parse_args(list(argv)))


def load_trace(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return json.load(fh)


def by_pid(events: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    lanes: dict[int, list[dict[str, Any]]] = {}
    for e in events:
        lanes.setdefault(e["pid"], []).append(e)
    return lanes


def lane_names(trace: dict[str, Any]) -> dict[int, str]:
    return {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}


@pytest.fixture()
def db(tmp_path: Path) -> Path:
    return make_db(tmp_path / "run.db")


def test_chrome_trace_format_and_lanes(db: Path, tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    assert run_export("--db", str(db), "--format", "chrome", str(out)) == 0
    trace = load_trace(out)
    assert trace["displayTimeUnit"] == "ms"
    assert trace["metadata"]["sessions"] == ["job-1"]
    events = trace["traceEvents"]
    for e in events:
        assert {"name", "ph", "pid", "tid"} <= e.keys()
        if e["ph"] != "M":
            assert isinstance(e["ts"], float | int)
        if e["ph"] == "X":
            assert e["dur"] >= 0
    names = lane_names(trace)
    assert len(names) == len(RANKS)  # one lane per rank
    assert sorted(names.values()) == sorted(f"node {n} / rank {g} (local {lr}) {h}" for g, lr, n, h in RANKS)
    # Lanes sorted by node, then rank.
    sort_index = {e["pid"]: e["args"]["sort_index"] for e in events if e["name"] == "process_sort_index"}
    ordered = [names[pid] for pid in sorted(sort_index, key=sort_index.__getitem__)]
    assert [n.split(" (")[0] for n in ordered] == [
        "node 0 / rank 0", "node 0 / rank 1", "node 1 / rank 2", "node 1 / rank 3"]


def test_steps_phases_nest_and_are_ordered(db: Path, tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    assert run_export("--db", str(db), "--format", "chrome", str(out)) == 0
    trace = load_trace(out)
    base = trace["metadata"]["base_epoch_s"]
    for pid, lane in by_pid([e for e in trace["traceEvents"] if e["ph"] != "M"]).items():
        ts = [e["ts"] for e in lane]
        assert ts == sorted(ts), f"lane {pid} not sorted by ts"
        step_events = [e for e in lane if e["cat"] == "step"]
        assert [e["name"] for e in step_events] == [f"step {s}" for s in range(N_STEPS)]
        for s, step in enumerate(step_events):
            end = (BASE_TS + (s + 1) * STEP_NS / 1e9 - base) * 1e6
            assert step["ts"] + step["dur"] == pytest.approx(end, abs=1.0)  # ends at the step's ts
            assert step["dur"] == pytest.approx(STEP_NS / 1e3)
            phases = [e for e in lane if e["cat"] == "phase" and e["args"]["step"] == s]
            # Back to back in execution order, h2d (not measured) skipped, ending at the step's end.
            assert [p["name"] for p in phases] == [p for p in PHASES if PHASE_NS[p] is not None]
            for a, b in zip(phases, phases[1:], strict=False):
                assert a["ts"] + a["dur"] == pytest.approx(b["ts"], abs=1e-3)
            assert phases[-1]["ts"] + phases[-1]["dur"] == pytest.approx(end, abs=1.0)
            for p in phases:  # nested inside the step slice, same track
                assert p["tid"] == step["tid"]
                assert step["ts"] - 1e-3 <= p["ts"] and p["ts"] + p["dur"] <= step["ts"] + step["dur"] + 1e-3
                assert p["dur"] == pytest.approx(PHASE_NS[p["name"]] / 1e3)


def test_spans_instants_and_counters(db: Path, tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    assert run_export("--db", str(db), "--format", "chrome", str(out)) == 0
    trace = load_trace(out)
    for lane in by_pid([e for e in trace["traceEvents"] if e["ph"] != "M"]).values():
        spans = {e["name"]: e for e in lane if e["cat"] == "span"}
        assert spans["fetch"]["ph"] == "X" and spans["fetch"]["dur"] == pytest.approx(2000.0)
        assert spans["fetch"]["args"]["step"] == 1 and "shard" in spans["fetch"]["args"]
        assert spans["eval"]["ph"] == "X" and spans["eval"]["dur"] == pytest.approx(3000.0)
        assert spans["checkpoint"]["ph"] == "i" and "dur" not in spans["checkpoint"]
        assert spans["checkpoint"]["args"] == {"args": "not json", "step": 2}
        counters = [e for e in lane if e["ph"] == "C"]
        assert len(counters) == N_STEPS
        # peak_bytes not measured on CPU: only rss_bytes is plotted.
        assert [c["args"] for c in counters] == [{"rss_bytes": 1000 + s} for s in range(N_STEPS)]


def test_step_range_and_gzip(db: Path, tmp_path: Path) -> None:
    out = tmp_path / "trace.json.gz"
    assert run_export("--db", str(db), "--format", "chrome", str(out), "--steps", "1:2") == 0
    assert out.read_bytes()[:2] == b"\x1f\x8b"
    trace = load_trace(out)
    assert trace["metadata"]["steps"] == [1, 2]
    events = [e for e in trace["traceEvents"] if e["ph"] != "M"]
    assert sorted({e["name"] for e in events if e["cat"] == "step"}) == ["step 1", "step 2"]
    assert {e["args"]["step"] for e in events if e["cat"] == "phase"} == {1, 2}
    spans = {e["name"] for e in events if e["cat"] == "span"}
    # fetch (step 1) and checkpoint (step 2) kept; eval (untagged, during step 3) outside the window.
    assert spans == {"fetch", "checkpoint"}


def test_sessions_and_restarts_get_separate_lanes(tmp_path: Path) -> None:
    db = make_db(tmp_path / "run.db", ranks=RANKS[:2])
    con = sqlite3.connect(db)
    add_run(con, RANKS[:2], 2, "job-1", attempt=1)
    add_run(con, RANKS[:2], 2, "job-2", attempt=0)
    con.commit()
    con.close()
    out = tmp_path / "all.json"
    assert run_export("--db", str(db), "--format", "chrome", str(out), "--all-sessions") == 0
    names = lane_names(load_trace(out))
    assert len(names) == 6 and all("attempt" in n for n in names.values())
    out = tmp_path / "one.json"
    assert run_export("--db", str(db), "--format", "chrome", str(out), "--session", "job-2") == 0
    trace = load_trace(out)
    assert trace["metadata"]["sessions"] == ["job-2"]
    assert len(lane_names(trace)) == 2
    # Without --session: the latest run, as every reader (job-2 was stored last).
    out = tmp_path / "latest.json"
    assert run_export("--db", str(db), "--format", "chrome", str(out)) == 0
    assert load_trace(out)["metadata"]["sessions"] == ["job-2"]
    # A session's restarts stay together, a lane set per attempt.
    out = tmp_path / "restarts.json"
    assert run_export("--db", str(db), "--format", "chrome", str(out), "--session", "job-1") == 0
    names = lane_names(load_trace(out))
    assert len(names) == 4 and {n.rsplit(" ", 1)[-1] for n in names.values()} == {"0]", "1]"}


def test_csv_rows(db: Path, tmp_path: Path) -> None:
    out = tmp_path / "steps.csv"
    assert run_export("--db", str(db), "--format", "csv", str(out)) == 0
    with open(out, newline="") as fh:
        rows = list(csv.reader(fh))
    header, body = rows[0], rows[1:]
    assert header[:3] == ["session", "attempt", "node_rank"]
    for col in ("global_rank", "local_rank", "step", "ts", "step_ms", "peak_bytes", "rss_bytes",
                *(f"{p}_ms" for p in PHASES)):
        assert col in header
    assert len(body) == len(RANKS) * N_STEPS
    first = dict(zip(header, body[0], strict=True))
    assert (first["node_rank"], first["global_rank"], first["step"]) == ("0", "0", "0")
    assert float(first["step_ms"]) == pytest.approx(10.0)
    assert float(first["forward_ms"]) == pytest.approx(3.0)
    assert first["h2d_ms"] == "" and first["peak_bytes"] == ""  # not measured stays empty, not zero

    out = tmp_path / "steps.csv.gz"
    assert run_export("--db", str(db), "--format", "csv", str(out), "--steps", "3:") == 0
    with gzip.open(out, "rt", newline="") as fh:
        assert len(list(csv.reader(fh))) == 1 + len(RANKS) * 2


def test_errors_name_the_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.db"
    assert run_export("--db", str(missing), "--format", "chrome", str(tmp_path / "t.json")) == 2
    assert str(missing) in capsys.readouterr().err

    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not sqlite" * 100)
    assert run_export("--db", str(garbage), "--format", "csv", str(tmp_path / "t.csv")) == 2
    err = capsys.readouterr().err
    assert str(garbage) in err and "not a traceml database" in err

    foreign = tmp_path / "foreign.db"
    con = sqlite3.connect(foreign)
    con.execute("CREATE TABLE t (x)")
    con.close()
    assert run_export("--db", str(foreign), "--format", "csv", str(tmp_path / "t.csv")) == 2
    err = capsys.readouterr().err
    assert str(foreign) in err and "not a traceml database" in err

    db = make_db(tmp_path / "run.db")
    assert run_export("--db", str(db), "--format", "svg", str(tmp_path / "t.svg")) == 2
    assert "unknown format 'svg'" in capsys.readouterr().err
    assert run_export("--db", str(db), "--format", "csv", str(tmp_path / "t.csv"), "--steps", "x:y") == 2
    assert "--steps" in capsys.readouterr().err
    assert run_export("--db", str(db), "--format", "csv", str(tmp_path / "t.csv"), "--session", "nope") == 2
    assert "job-1" in capsys.readouterr().err
    unwritable = tmp_path / "no-such-dir" / "t.csv"
    assert run_export("--db", str(db), "--format", "csv", str(unwritable)) == 2
    assert str(unwritable) in capsys.readouterr().err


def test_export_leaves_the_database_untouched(db: Path, tmp_path: Path) -> None:
    before = db.read_bytes()
    db.chmod(0o444)  # read-only open must not need write access to the file
    try:
        assert run_export("--db", str(db), "--format", "chrome", str(tmp_path / "t.json")) == 0
    finally:
        db.chmod(0o644)
    assert db.read_bytes() == before


@pytest.mark.slow
def test_real_run(real_run_db: Path, tmp_path: Path) -> None:
    from tests.conftest import REAL_RUN_STEPS

    out = tmp_path / "real.json.gz"
    assert run_export("--db", str(real_run_db), "--format", "chrome", str(out)) == 0
    trace = load_trace(out)
    assert len(lane_names(trace)) == 2
    for lane in by_pid([e for e in trace["traceEvents"] if e["ph"] != "M"]).values():
        steps = [e for e in lane if e["cat"] == "step"]
        assert len(steps) >= REAL_RUN_STEPS
        ts = [e["ts"] for e in lane]
        assert ts == sorted(ts)
        for step in steps:
            inner = [e for e in lane if e["cat"] == "phase" and e["args"]["step"] == step["args"]["step"]]
            assert {p["name"] for p in inner} >= {"forward", "backward", "optimizer"}
            for p in inner:
                assert step["ts"] - 1e-3 <= p["ts"] and p["ts"] + p["dur"] <= step["ts"] + step["dur"] + 1e-3
        assert any(e["ph"] == "C" and "rss_bytes" in e["args"] for e in lane)
    csv_out = tmp_path / "real.csv"
    assert run_export("--db", str(real_run_db), "--format", "csv", str(csv_out)) == 0
    with open(csv_out, newline="") as fh:
        assert len(list(csv.reader(fh))) - 1 >= 2 * REAL_RUN_STEPS


def _no_constants(name: str) -> Any:
    raise AssertionError(f"not strict JSON: {name}")


def test_chrome_trace_is_strict_json_and_never_draws_a_negative_duration(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = make_db(tmp_path / "bad.db", ranks=RANKS[:1])
    inf = float("inf")
    con = sqlite3.connect(db)
    con.execute("UPDATE steps SET step_ns=? WHERE step=2", (inf,))  # SQLite stores an infinity (a NaN: NULL)
    con.execute("UPDATE steps SET rss_bytes=? WHERE step=1", (-inf,))
    con.execute("UPDATE steps SET forward_ns=-1000000 WHERE step=3")
    con.execute("UPDATE steps SET step_ns=-5000000 WHERE step=4")
    con.execute("INSERT INTO spans (rank_id, name, start_ns, dur_ns, step, args) VALUES (1, 'backwards', ?, -2000000, 1, ?)",
                (int((BASE_TS + 0.012) * 1e9), '{"loss": NaN, "lr": Infinity}'))  # what json.dumps writes by default
    con.execute("INSERT INTO spans (rank_id, name, start_ns, dur_ns, step, args) VALUES (1, 'nowhere', ?, 1000, NULL, NULL)", (inf,))
    con.commit()
    assert con.execute("SELECT typeof(step_ns) FROM steps WHERE step=2").fetchone() == ("real",)
    con.close()
    out = tmp_path / "trace.json"
    assert run_export("--db", str(db), "--format", "chrome", str(out)) == 0
    trace = json.loads(out.read_text(), parse_constant=_no_constants)
    meta = trace["metadata"]
    # step_ns inf, rss -inf, the span args' NaN and Infinity, the span start inf.
    assert meta["non_finite_values"] == 5
    # step 3's forward, step 4's step, the span's duration.
    assert meta["negative_durations"] == 3
    err = capsys.readouterr().err
    assert "(5 non-finite values written as null, 3 negative durations left out)" in err
    events = [e for e in trace["traceEvents"] if e["ph"] != "M"]
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")
    steps = {e["name"]: e for e in events if e["cat"] == "step"}
    assert steps["step 2"]["ph"] == "X" and steps["step 2"]["args"]["step_ms"] is None
    assert steps["step 3"]["ph"] == "X" and steps["step 3"]["args"]["negative_durations"] == ["forward"]
    assert steps["step 3"]["args"]["forward_ms"] == -1.0  # the stored value, not drawn
    assert not [e for e in events if e["cat"] == "phase" and e["name"] == "forward" and e["args"]["step"] == 3]
    assert steps["step 4"]["ph"] == "i" and steps["step 4"]["args"]["negative_durations"] == ["step"]
    assert steps["step 4"]["args"]["step_ms"] == -5.0
    spans = {e["name"]: e for e in events if e["cat"] == "span"}
    assert spans["backwards"]["ph"] == "i" and spans["backwards"]["args"]["negative_duration_ms"] == -2.0
    assert spans["backwards"]["args"]["loss"] is None and spans["backwards"]["args"]["lr"] is None
    assert "nowhere" not in spans  # no time to place it at
    # Step 1's only memory value was -inf: no counter drawn for it.
    assert len([e for e in events if e["ph"] == "C"]) == N_STEPS - 1
