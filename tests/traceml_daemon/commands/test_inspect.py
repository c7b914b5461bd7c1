"""``traceml-daemon inspect`` on a real 3-rank torchrun job through the real daemon,
rank 1 held in backward at every step: every rank's row, rank 1 named out of band by
backward, the details of one rank, and errors that say what exists."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.procs import EXAMPLES, DaemonProcess, base_env, cli, free_port, torchrun, wait_for_steps
from traceml_daemon.store.read.runs import latest_run
from traceml_daemon.store.read.step_detail import StepNotFound, load_step

STEPS = 40
STEP = 30


@pytest.fixture(scope="module")
def straggler_db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    db = tmp_path_factory.mktemp("inspect") / "job.db"
    with DaemonProcess(db) as daemon:
        env = base_env(TRACEML_DAEMON=daemon.address, TRACEML_RELAY_PORT=str(free_port()))
        done = torchrun(EXAMPLES / "scenarios" / "backward_straggler.py", ["--steps", str(STEPS), "--ms", "30"],
                        nproc=3, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        wait_for_steps(db, ranks=3, steps=STEPS)
    yield db


def _inspect(db: Path, *args: str) -> dict[str, Any]:
    done = cli("inspect", "--db", str(db), "--json", *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_every_rank_has_its_row_and_the_held_rank_is_out_of_band(straggler_db: Path) -> None:
    view = _inspect(straggler_db, "--step", str(STEP))
    assert view["step"] == STEP and view["ranks_recorded"] == 3
    assert view["parallelism"] == "ddp" and (view["first_step"], view["last_step"]) == (0, STEPS - 1)
    assert [r["global_rank"] for r in view["ranks"]] == [0, 1, 2]
    for r in view["ranks"]:
        (model,) = r["models"]
        assert model["step_ms"] > 0 and model["phases_ms"]["backward"] is not None
        assert model["comm_ms"] is not None  # DDP's all-reduce, measured by the comm hook
        assert r["scalars"]["loss"] is not None  # agent.log(loss=...) of this very step
        assert r["status"]["finished"] is True and r["process"]["rss_bytes"] > 0
    (held,) = view["out_of_band"]
    assert (held["global_rank"], held["phase"], held["verdict"]) == (1, "backward", "COMPUTE_STRAGGLER")
    assert held["excess_ms"] >= 15 and held["phase_excess_ms"] >= 15
    backward = {r["global_rank"]: r["models"][0]["phases_ms"]["backward"] for r in view["ranks"]}
    assert backward[1] - max(backward[0], backward[2]) >= 15

    text = cli("inspect", "--db", str(straggler_db), "--step", str(STEP)).stdout
    assert f"Step {STEP} of session" in text and "3 of 3 rank(s) recorded it" in text
    assert "rank 1 (node 0): +" in text and "-> COMPUTE_STRAGGLER" in text
    assert "Rank 0 (node 0" in text and "Rank 2 (node 0" in text and "scalars: loss=" in text


def test_one_rank_in_detail(straggler_db: Path) -> None:
    text = cli("inspect", "--db", str(straggler_db), "--step", str(STEP), "--rank", "1").stdout
    assert "Rank 1 (node 0" in text and "Rank 0 (node 0" not in text
    assert "rank 1 (node 0): +" in text  # the band is still of every rank


def test_errors_name_what_exists(straggler_db: Path) -> None:
    done = cli("inspect", "--db", str(straggler_db), "--step", "5000")
    assert done.returncode == 2
    assert "step 5000 is not stored for session" in done.stderr and f"steps 0-{STEPS - 1} are stored" in done.stderr
    done = cli("inspect", "--db", str(straggler_db), "--step", "3", "--rank", "8")
    assert done.returncode == 2 and "rank 8 is not in session" in done.stderr and "(ranks 0-2)" in done.stderr
    done = cli("inspect", "--db", str(straggler_db), "--step", "3", "--session", "nope")
    assert done.returncode == 2 and "no session 'nope'" in done.stderr
    conn = sqlite3.connect(f"file:{straggler_db}?mode=ro", uri=True)
    run = latest_run(conn)
    assert run is not None
    with pytest.raises(StepNotFound):
        load_step(conn, run, -1)
    conn.close()
