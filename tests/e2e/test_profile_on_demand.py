"""`traceml-daemon profile` during a real 2-rank torchrun job through the real daemon and the
node's relay: rank 1 records exactly the 3 steps asked, rank 0 records nothing, the trace is
a readable torch.profiler file, listed by summary and linked from the step inspector; errors
name a rank that is not in the run, a run that finished and a database no daemon serves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.procs import REPO, DaemonProcess, base_env, cli, free_port, torchrun, wait_for_steps

pytestmark = pytest.mark.slow
JOB = REPO / "tests" / "support" / "profile_job.py"
STEPS = 3


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("profile")
    db = tmp / "run.db"
    stop = tmp / "stop"
    profiles = tmp / "profiles"
    daemon = DaemonProcess(db).start()
    job = None
    try:
        env = base_env(TRACEML_DAEMON=daemon.address, TRACEML_RELAY_PORT=str(free_port()),
                       TRACEML_PROFILE_DIR=str(profiles), TRACEML_FLUSH_S="0.2")
        job = torchrun(JOB, ["--steps", "3000", "--step-s", "0.02", "--stop-file", str(stop)], nproc=2, env=env,
                       background=True)
        wait_for_steps(db, ranks=2, steps=5, timeout=120)
        missing = cli("profile", "--db", str(db), "--rank", "7", "--steps", "3")
        asked = cli("profile", "--db", str(db), "--rank", "1", "--steps", str(STEPS), "--wait", "90", "--json")
        stop.touch()
        out, _ = job.communicate(timeout=120)
        assert job.returncode == 0, out
        finished = cli("profile", "--db", str(db), "--rank", "1", "--steps", "3")
    finally:
        if job is not None and job.poll() is None:
            job.kill()
        code = daemon.stop()
    assert code == 0, daemon.log()
    stopped = cli("profile", "--db", str(db), "--rank", "1", "--steps", "3")
    return {"db": db, "tmp": tmp, "profiles": profiles, "asked": asked, "missing": missing, "finished": finished,
            "stopped": stopped, "log": daemon.log()}


def test_the_cli_names_the_trace_of_exactly_the_rank_and_steps_asked(run: dict[str, Any]) -> None:
    asked = run["asked"]
    assert asked.returncode == 0, asked.stderr
    trace = json.loads(asked.stdout)
    assert trace["rank"] == 1 and trace["steps"] == STEPS
    assert Path(trace["path"]).parent == run["profiles"]
    assert "rank1" in Path(trace["path"]).name


def test_the_trace_is_a_readable_torch_profiler_file_of_three_steps(run: dict[str, Any]) -> None:
    (path,) = run["profiles"].iterdir()  # rank 0 wrote none
    events = json.loads(path.read_text())["traceEvents"]
    names = [e.get("name") for e in events]
    # The job's one nn.Linear runs once per step's forward: three steps, three calls.
    assert names.count("aten::linear") == STEPS
    assert any(e.get("ph") == "X" and e.get("cat") == "cpu_op" for e in events)


def test_summary_lists_only_rank_1(run: dict[str, Any]) -> None:
    done = cli("summary", "--db", str(run["db"]), "--json")
    assert done.returncode == 0, done.stderr
    profiles = json.loads(done.stdout)["profiles"]
    assert [(p["rank"], p["steps"]) for p in profiles] == [(1, STEPS)]


def test_the_step_inspector_links_the_trace(run: dict[str, Any]) -> None:
    trace = json.loads(run["asked"].stdout)
    step = trace["step"] + 1  # inside the profiled range
    done = cli("inspect", "--db", str(run["db"]), "--step", str(step), "--json")
    assert done.returncode == 0, done.stderr
    view = json.loads(done.stdout)
    assert [(p["rank"], p["step"], p["steps"], p["path"]) for p in view["profiles"]] == [
        (1, trace["step"], STEPS, trace["path"])
    ]
    text = cli("inspect", "--db", str(run["db"]), "--step", str(step))
    assert trace["path"] in text.stdout
    outside = json.loads(cli("inspect", "--db", str(run["db"]), "--step", str(trace["step"] + STEPS), "--json").stdout)
    assert outside["profiles"] == []


def test_errors_name_what_was_wrong(run: dict[str, Any]) -> None:
    missing = run["missing"]
    assert missing.returncode == 2
    assert "no rank 7" in missing.stderr and "ranks 0-1" in missing.stderr
    finished = run["finished"]
    assert finished.returncode == 2
    assert "rank 1 of session" in finished.stderr and "run finished" in finished.stderr, finished.stderr
    stopped = run["stopped"]
    assert stopped.returncode == 2
    assert "no daemon serves" in stopped.stderr and "traceml-daemon serve --db" in stopped.stderr, stopped.stderr


def test_no_daemon_no_database(tmp_path: Path) -> None:
    done = cli("profile", "--db", str(tmp_path / "none.db"), "--rank", "0", "--steps", "3")
    assert done.returncode == 2 and "no database" in done.stderr
