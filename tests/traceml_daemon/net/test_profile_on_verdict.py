"""`traceml-daemon serve --profile-on-verdict K` with the real daemon, its relay and a real
2-rank torchrun gloo job whose rank 1 is slow: the daemon's own diagnosis names rank 1 a
straggler, rank 1 (and only rank 1) records K steps with torch.profiler, the trace file is
written and listed, and the daemon asks exactly once although the verdict persists."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.support.procs import EXAMPLES, DaemonProcess, base_env, free_port, summary, torchrun, wait_for

pytestmark = pytest.mark.slow
STEPS = 3
# Rank 1's collate sleeps 30 ms a step: the job lasts well past the warm-up and minimum
# steps of the straggler rule and several of the watcher's passes after its request.
JOB_ARGS = ["--steps", "1200", "--slow-ranks", "1", "--slow-ms", "30"]
ASKED = re.compile(r"profile on verdict: (\w+) names rank (\d+) of session \S+: asked for its next (\d+) steps "
                   r"\(request [0-9a-f]+\): (.*)")


def _profiles(db: Path) -> list[dict[str, Any]] | None:
    s = summary(db)
    return s["profiles"] if s and s.get("profiles") else None


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("profile_on_verdict")
    db = tmp / "run.db"
    profiles = tmp / "profiles"
    daemon = DaemonProcess(db, args=["--profile-on-verdict", str(STEPS)]).start()
    job = None
    try:
        env = base_env(TRACEML_DAEMON=daemon.address, TRACEML_RELAY_PORT=str(free_port()),
                       TRACEML_PROFILE_DIR=str(profiles), TRACEML_FLUSH_S="0.2")
        job = torchrun(EXAMPLES / "train.py", JOB_ARGS, nproc=2, env=env, background=True)
        # A pass after the request still sees the verdict (and says it does not ask again).
        wait_for(lambda: "not asking again" in daemon.log(), timeout=300, interval=0.5,
                 what="the straggler verdict seen again after the request:\n" + daemon.log())
        listed = wait_for(lambda: _profiles(db), timeout=180, interval=1.0, what="a profiles row")
        out, _ = job.communicate(timeout=600)
        assert job.returncode == 0, out
        final = summary(db)
    finally:
        if job is not None and job.poll() is None:
            job.kill()
            job.communicate()
        code = daemon.stop()
    assert code == 0, daemon.log()
    return {"profiles": profiles, "listed": listed, "final": final, "log": daemon.log()}


def test_the_slow_rank_alone_records_the_steps_asked(run: dict[str, Any]) -> None:
    listed = run["final"]["profiles"]
    assert [(p["rank"], p["steps"]) for p in listed] == [(1, STEPS)], run["log"]
    (trace,) = run["profiles"].iterdir()  # rank 0 wrote none
    assert Path(listed[0]["path"]) == trace
    assert "rank1" in trace.name
    assert trace.stat().st_size > 0


def test_exactly_one_request_for_the_persisting_verdict(run: dict[str, Any]) -> None:
    asked = [m.groups() for m in ASKED.finditer(run["log"])]
    assert len(asked) == 1, run["log"]
    name, rank, steps, outcome = asked[0]
    assert name.endswith("STRAGGLER") and name != "NODE_STRAGGLER"
    assert (int(rank), int(steps)) == (1, STEPS)
    assert outcome.startswith("sent to "), outcome
    again = [line for line in run["log"].splitlines() if "not asking again" in line]
    assert len(again) == 1 and "still names rank 1 of session" in again[0], run["log"]
    # The run's own summary still blames rank 1 at the end.
    blamed = [v for v in run["final"]["verdicts"] if v["name"].endswith("STRAGGLER")]
    assert [v["scope"].get("global_rank") for v in blamed] == [1]
