"""Numerics fingerprints through real torchrun gloo jobs and the real daemon: a replica one ULP
off is named with its step, rank and layer; a NaN gradient with its step, rank and layer; two
seeded runs, one with a layer's learning rate changed from step K, part at step K in that layer."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from tests.support.procs import EXAMPLES, DaemonProcess, base_env, cli, free_port, torchrun, wait_for
from traceml_daemon.analysis.engine import diagnose
from traceml_daemon.store.reader import load_window_run

SCRIPT = EXAMPLES / "numerics.py"


def _fingerprint_steps(db: Path) -> dict[int, int]:
    """Per global rank, the fingerprinted steps stored so far."""
    if not db.exists():
        return {}
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        try:
            rows = conn.execute("SELECT r.global_rank, COUNT(DISTINCT f.step) FROM fingerprints f "
                                "JOIN ranks r ON r.rank_id = f.rank_id GROUP BY r.global_rank").fetchall()
        except sqlite3.OperationalError:
            return {}
    return dict(rows)


def _run(db: Path, ranks: int, steps: int, *script_args: str, **env: str) -> None:
    with DaemonProcess(db) as daemon:
        job_env = base_env(TRACEML_DAEMON=daemon.address, TRACEML_RELAY_PORT=str(free_port()), **env)
        done = torchrun(SCRIPT, ["--steps", str(steps), *script_args], nproc=ranks, env=job_env)
        assert done.returncode == 0, done.stdout + done.stderr
        wait_for(lambda: (lambda s: len(s) == ranks and all(n == steps for n in s.values()))(_fingerprint_steps(db)),
                 timeout=60, what=f"every rank's {steps} fingerprints in {db}")


def _verdicts(db: Path) -> dict[str, dict[str, Any]]:
    done = cli("summary", "--db", str(db), "--json", "--no-files")
    assert done.returncode == 0, done.stderr
    return {v["name"]: v for v in json.loads(done.stdout)["verdicts"]}


def test_a_replica_one_ulp_off_and_a_nan_gradient_are_named(tmp_path: Path) -> None:
    db = tmp_path / "ddp.db"
    # Rank 2 moves one element of the second Linear's weight by one ULP after step 30's optimizer step;
    # rank 1 sets one of its gradient values to NaN at step 40 (after the all-reduce: its own only).
    _run(db, 3, 44, "--fingerprint-every", "1", "--flip-rank", "2", "--flip-step", "30",
         "--nan-rank", "1", "--nan-step", "40")
    verdicts = _verdicts(db)
    replica = verdicts["REPLICA_DIVERGED"]
    ev = replica["evidence"]
    assert (ev["step"], ev["ranks"], ev["layer"]) == (30, [2], "module.2.weight"), replica
    assert ev["majority"] is True and ev["majority_ranks"] == [0, 1] and replica["scope"] == {"global_rank": 2}
    assert ev["expected"]["param_sum"] - ev["found"]["2"]["param_sum"] in (1, -1)  # the bits moved by one ULP
    grads = verdicts["GRAD_NONFINITE"]
    ev = grads["evidence"]
    assert (ev["step"], ev["global_rank"], ev["layer"], ev["grad_nonfinite"]) == (40, 1, "module.2.weight", 1), grads
    # The live view (the TUI's analyzer reads each rank's newest steps) raises both as well.
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        live = {v.name: v for v in diagnose(load_window_run(conn, window=50))}
        # Rank 1's weight went NaN through the optimizer at step 40: stored as NaN, not as "no value".
        (norm,) = conn.execute("SELECT f.param_norm FROM fingerprints f JOIN ranks r ON r.rank_id = f.rank_id "
                               "WHERE r.global_rank = 1 AND f.step = 40 AND f.layer = 'module.2.weight'").fetchone()
        assert norm == "NaN"
    assert live["REPLICA_DIVERGED"].evidence["step"] == 30 and live["GRAD_NONFINITE"].evidence["step"] == 40
    # The database the real daemon wrote passes every integrity check.
    done = cli("validate", "--db", str(db))
    assert done.returncode == 0, done.stdout + done.stderr


def test_replicas_that_agree_raise_nothing(tmp_path: Path) -> None:
    db = tmp_path / "clean.db"
    _run(db, 2, 20, TRACEML_FINGERPRINT_EVERY="1")
    verdicts = _verdicts(db)
    assert "REPLICA_DIVERGED" not in verdicts and "GRAD_NONFINITE" not in verdicts


def test_compare_finds_the_step_and_layer_where_a_learning_rate_change_parts_two_runs(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a.db", tmp_path / "b.db", tmp_path / "c.db"
    _run(a, 1, 35, "--seed", "5", TRACEML_FINGERPRINT_EVERY="1")
    _run(b, 1, 35, "--seed", "5", "--lr-from", "25", "--layer", "2.weight", TRACEML_FINGERPRINT_EVERY="1")
    done = cli("compare", str(a), str(b), "--json")
    assert done.returncode == 4, done.stdout + done.stderr
    result = json.loads(done.stdout)
    first = result["fingerprints"]["first_divergence"]
    assert (first["step"], first["layer"], first["metric"]) == (25, "2.weight", "param_norm"), first
    assert first["a"]["param_norm"] != first["b"]["param_norm"]
    # Step 25's loss came before its optimizer step: the logged scalars part one step later.
    assert result["scalars"]["first_divergence"]["first_divergent_step"] == 26
    text = cli("compare", str(a), str(b))
    assert text.returncode == 4 and "Fingerprints: first divergence at step 25, layer 2.weight" in text.stdout
    # The same seed without the change: identical, exit 0.
    _run(c, 1, 35, "--seed", "5", TRACEML_FINGERPRINT_EVERY="1")
    done = cli("compare", str(a), str(c), "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    same = json.loads(done.stdout)
    assert same["fingerprints"]["identical"] is True and same["scalars"]["identical"] is True


def test_fsdp2_ranks_fingerprint_their_shards_and_the_daemon_adds_the_squares(tmp_path: Path) -> None:
    a = tmp_path / "fsdp.db"
    with DaemonProcess(a) as daemon:
        env = base_env(TRACEML_DAEMON=daemon.address, TRACEML_RELAY_PORT=str(free_port()),
                       TRACEML_FINGERPRINT_EVERY="1")
        done = torchrun(EXAMPLES / "train.py", ["--steps", "8", "--fsdp", "--seed", "3"], nproc=2, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        wait_for(lambda: (lambda s: len(s) == 2 and all(n == 8 for n in s.values()))(_fingerprint_steps(a)),
                 timeout=60, what="both ranks' fingerprints")
    with sqlite3.connect(f"file:{a}?mode=ro", uri=True) as conn:
        shards = conn.execute("SELECT DISTINCT shard FROM fingerprints").fetchall()
        rows = conn.execute("SELECT r.global_rank, f.param_norm FROM fingerprints f JOIN ranks r "
                            "ON r.rank_id = f.rank_id WHERE f.step = 7 AND f.idx = 0 ORDER BY r.global_rank").fetchall()
    assert shards == [(1,)]  # every row is a rank's local shard
    assert len(rows) == 2 and rows[0][1] != rows[1][1]  # two different halves of the first weight
    # Shards differ by design: no replica verdict under FSDP2; the run against itself is identical,
    # compared on the full norms the daemon adds up from the shards' squares.
    assert "REPLICA_DIVERGED" not in _verdicts(a)
    done = cli("compare", str(a), str(a), "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    fps = json.loads(done.stdout)["fingerprints"]
    assert fps["identical"] is True and fps["layers_compared"] > 0
