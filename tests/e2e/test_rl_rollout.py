"""examples/rl_rollout.py under torchrun (2 ranks) through the real daemon: rollout sessions
arrive whole, the sessions command lays them out as AReaL does, the Chrome export draws
spans and session lanes, and the rollout verdicts see the long tail and the rejections."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.procs import EXAMPLES, DaemonProcess, base_env, cli, free_port, torchrun

pytestmark = pytest.mark.slow
STEPS = 10
PROFILED = 3  # torch.profiler on this trainer step


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("rl")
    db = tmp / "rl.db"
    report = tmp / "counts"
    daemon = DaemonProcess(db).start()
    try:
        env = base_env(TRACEML_DAEMON=daemon.address, TRACEML_RELAY_PORT=str(free_port()),
                       TRACEML_PROFILE_STEPS=str(PROFILED), TRACEML_PROFILE_DIR=str(tmp / "profiles"))
        done = torchrun(EXAMPLES / "rl_rollout.py", ["--steps", str(STEPS), "--report", str(report)], nproc=2,
                        env=env, timeout=240)
        assert done.returncode == 0, done.stdout + done.stderr
    finally:
        code = daemon.stop()
    assert code == 0, daemon.log()
    counts = {rank: json.loads(Path(f"{report}.{rank}").read_text()) for rank in (0, 1)}
    return {"db": db, "tmp": tmp, "counts": counts, "output": done.stdout + done.stderr}


def test_every_session_arrives_with_its_status_and_phases(run: dict[str, Any]) -> None:
    out = run["tmp"] / "sessions.jsonl"
    done = cli("sessions", "--db", str(run["db"]), "--jsonl", str(out))
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    for rank, counts in run["counts"].items():
        mine = [r for r in records if r["rank"] == rank]
        assert len(mine) == counts["registered"], (rank, counts)
        assert len({r["session_id"] for r in mine}) == len(mine)
        statuses = [r["status"] for r in mine]
        assert statuses.count("accepted") == counts["accepted"]
        assert statuses.count("rejected") == counts["rejected"]
        assert statuses.count("dropped") == counts["registered"] - counts["accepted"] - counts["rejected"]
        assert "pending" not in statuses  # every episode in flight at the end was dropped by task
        assert len({r["task_id"] for r in mine}) <= counts["tasks"]
    for r in records:
        assert set(r) >= {"task_id", "session_id", "rank", "status", "submit_ts", "finalized_ts", "total_s", "phases"}
        assert r["total_s"] == pytest.approx(r["finalized_ts"] - r["submit_ts"])
        if r["status"] == "rejected":
            assert r["reason"] == "stale_weight"
        if r["status"] == "dropped":
            assert r["reason"] == "training_ended"
            continue
        assert set(r["phases"]) >= {"generate", "reward"}
        for phase, execs in r["phases"].items():
            assert r[f"{phase}_s"] == pytest.approx(sum(e["end_ts"] - e["start_ts"] for e in execs))
            for e in execs:
                assert r["submit_ts"] <= e["start_ts"] <= e["end_ts"] <= r["finalized_ts"]
        assert r["phases"]["generate"][0]["start_payload"]["prompt"] > 0
    assert any("toolcall" in r["phases"] for r in records)


def test_summary_and_verdicts(run: dict[str, Any]) -> None:
    done = cli("sessions", "--db", str(run["db"]), "--json")
    assert done.returncode == 0, done.stderr
    s = json.loads(done.stdout)
    registered = sum(c["registered"] for c in run["counts"].values())
    assert s["sessions"] == registered == len(s["sessions_list"])
    assert s["statuses"]["accepted"] == sum(c["accepted"] for c in run["counts"].values())
    assert s["reasons"]["rejected: stale_weight"] == sum(c["rejected"] for c in run["counts"].values())
    gen = s["phases"]["generate"]
    assert gen["p50_s"] <= gen["p95_s"] <= gen["p99_s"] <= gen["max_s"]
    names = {v["name"] for v in s["verdicts"]}
    assert {"ROLLOUT_LONG_TAIL", "ROLLOUT_REJECTIONS_HIGH"} <= names, s["verdicts"]
    tail = next(v for v in s["verdicts"] if v["name"] == "ROLLOUT_LONG_TAIL" and v["evidence"]["phase"] == "generate")
    assert tail["evidence"]["p99_s"] > 5 * tail["evidence"]["p50_s"]
    rej = next(v for v in s["verdicts"] if v["name"] == "ROLLOUT_REJECTIONS_HIGH")
    assert rej["evidence"]["main_reason"] == "rejected: stale_weight"
    assert s["trainer"]["steps"] == 2 * STEPS
    text = cli("sessions", "--db", str(run["db"]))
    assert text.returncode == 0 and "generate" in text.stdout and "stale_weight" in text.stdout, text.stdout


def test_chrome_export_has_spans_by_lane_and_session_rows(run: dict[str, Any]) -> None:
    out = run["tmp"] / "trace.json"
    done = cli("export", "--db", str(run["db"]), "--format", "chrome", str(out))
    assert done.returncode == 0, done.stderr
    events = json.loads(out.read_text())["traceEvents"]
    pids = {e["pid"] for e in events if e.get("cat") == "session"}
    assert len(pids) == 2  # both ranks merged in one trace
    sessions = [e for e in events if e.get("cat") == "session"]
    assert len(sessions) == sum(c["registered"] for c in run["counts"].values())
    rows = {(e["pid"], e["tid"]) for e in sessions}
    assert len(rows) < len(sessions) / 4  # packed: sessions that do not overlap share a row
    by_row: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in sessions:
        by_row.setdefault((e["pid"], e["tid"]), []).append(e)
    for row in by_row.values():  # a row's sessions never overlap
        row.sort(key=lambda e: e["ts"])
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(row, row[1:], strict=False))
    phases = {e["name"] for e in events if e.get("cat") == "session_phase"}
    assert {"generate", "reward"} <= phases
    waits = [e for e in events if e.get("name") == "trainer.wait_rollouts"]
    assert len(waits) == 2 * STEPS and all(e["cat"] == "scheduler" and "global_step" in e["args"] for e in waits)
    gens = [e for e in events if e.get("name") == "engine.agenerate"]
    assert gens and all(e["cat"] == "io" for e in gens)
    names = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert any(n.startswith("tasks ") for n in names) and any(n.startswith("sessions ") for n in names)


def test_the_listed_step_is_profiled_on_every_rank_and_listed(run: dict[str, Any]) -> None:
    done = cli("summary", "--db", str(run["db"]), "--json", "--no-files")
    assert done.returncode == 0, done.stderr
    s = json.loads(done.stdout)
    profiles = sorted(s["profiles"], key=lambda p: p["rank"])
    assert [(p["rank"], p["step"], p["steps"]) for p in profiles] == [(0, PROFILED, 1), (1, PROFILED, 1)]
    for p in profiles:
        path = Path(p["path"])
        assert path.parent == run["tmp"] / "profiles" and path.is_file()
        assert json.loads(path.read_text())["traceEvents"]  # a torch.profiler Chrome trace
    assert s["rollout_sessions"] > 0
    assert {"ROLLOUT_LONG_TAIL", "ROLLOUT_REJECTIONS_HIGH"} <= {v["name"] for v in s["verdicts"]}
    text = cli("summary", "--db", str(run["db"]), "--no-files")
    assert "torch.profiler traces" in text.stdout and "traceml-daemon sessions" in text.stdout, text.stdout
