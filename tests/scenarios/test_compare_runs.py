"""`traceml-daemon compare` on two real seeded runs: a 2-rank torchrun job of
examples/train.py twice, each through its own real daemon into its own
database, the second perturbed from step K on; compare must name step K as
the first divergent step, with both runs' values."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from tests.support.procs import EXAMPLES, DaemonProcess, base_env, cli, free_port, torchrun, wait_for, wait_for_steps

STEPS = 30
PERTURB_FROM = 12
RANKS = 2


def _stored_losses(db: Path) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return conn.execute("SELECT COUNT(*) FROM scalars WHERE name = 'loss'").fetchone()[0]


def _run(db: Path, *extra: str) -> None:
    with DaemonProcess(db) as daemon:
        env = base_env(TRACEML_DAEMON=daemon.address, TRACEML_RELAY_PORT=str(free_port()))
        done = torchrun(EXAMPLES / "train.py", ["--steps", str(STEPS), "--seed", "7", *extra], nproc=RANKS, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        wait_for_steps(db, ranks=RANKS, steps=STEPS)
        wait_for(lambda: _stored_losses(db) >= RANKS * STEPS, timeout=60, what=f"every logged loss in {db}")


def test_compare_names_the_step_where_the_perturbed_run_diverges(tmp_path: Path) -> None:
    a, b = tmp_path / "a.db", tmp_path / "b.db"
    _run(a)
    # The targets shift from step K on: step K's logged loss is the first computed from other data,
    # and everything before it (same seed, same data, 1 thread, gloo sum of 2) is bit for bit equal.
    _run(b, "--perturb-from", str(PERTURB_FROM))
    done = cli("compare", str(a), str(b), "--json")
    assert done.returncode == 4, done.stderr  # divergence detected
    scalars: dict[str, Any] = json.loads(done.stdout)["scalars"]
    assert scalars["ulp"] == 0 and scalars["identical"] is False
    first = scalars["first_divergence"]
    assert (first["name"], first["rank"], first["first_divergent_step"]) == ("loss", 0, PERTURB_FROM), first
    assert isinstance(first["a"], float) and isinstance(first["b"], float) and first["a"] != first["b"], first
    losses = {s["rank"]: s for s in scalars["series"] if s["name"] == "loss"}
    assert sorted(losses) == list(range(RANKS))
    for series in losses.values():
        # every rank: all steps compared, the first PERTURB_FROM equal, step K different
        assert series["steps_compared"] == STEPS and series["first_divergent_step"] == PERTURB_FROM, series
    # A run against itself is identical: the divergence is the perturbation, not noise.
    same = json.loads(cli("compare", str(a), str(a), "--json").stdout)["scalars"]
    assert same["identical"] is True and same["first_divergence"] is None
