"""FSDP2 stragglers (examples/scenarios/fsdp2_straggler.py): real torchrun gloo FSDP2 jobs
through the real daemon. Every rank's step is the same length (the others wait for the
slow rank inside their own backward); the final summary must name the slow rank, in
backward, and no other rank, from the collective wait the agent measured."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.support.procs import EXAMPLES, DaemonProcess, base_env, cli, free_port, torchrun, wait_for_steps

SCENARIO = EXAMPLES / "scenarios" / "fsdp2_straggler.py"
STEPS = 30
STRAGGLERS = {"INPUT_STRAGGLER", "H2D_STRAGGLER", "COMPUTE_STRAGGLER", "WAIT_STRAGGLER", "STRAGGLER", "NODE_STRAGGLER"}


def _run(tmp_path: Path, nproc: int, *args: str, **env_extra: str) -> tuple[dict[str, Any], Path, str]:
    db = tmp_path / "fsdp2.db"
    with DaemonProcess(db) as daemon:
        env = base_env(TRACEML_DAEMON=daemon.address, TRACEML_RELAY_PORT=str(free_port()), **env_extra)
        done = torchrun(SCENARIO, ["--steps", str(STEPS), *args], nproc=nproc, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        return wait_for_steps(db, ranks=nproc, steps=STEPS), db, done.stdout + done.stderr


def _stragglers(s: dict[str, Any]) -> list[dict[str, Any]]:
    return [v for v in s["verdicts"] if v["name"] in STRAGGLERS]


def _by_rank(s: dict[str, Any]) -> list[dict[str, Any]]:
    return sorted(s["ranks"], key=lambda r: r["global_rank"])


def test_rank_slow_in_backward_is_the_only_straggler_and_the_summary_shows_wait_and_shards(tmp_path: Path) -> None:
    s, db, _ = _run(tmp_path, 2, "--ms", "40", "--slow-rank", "1")
    assert s["topology"]["parallelism"] == "fsdp2"
    strag = _stragglers(s)
    assert [(v["name"], v["scope"].get("global_rank")) for v in strag] == [("COMPUTE_STRAGGLER", 1)], s["verdicts"]
    v = strag[0]
    assert v["evidence"]["phase"] == "backward", v
    # the waiting rank's backward collectives hold the slow rank's extra work
    mine, others = v["evidence"]["collective_wait_ms"], v["evidence"]["others_collective_wait_ms"]
    assert others["backward"] - mine["backward"] >= 20.0, v
    assert "waiting in collectives" in v["why"], v
    for r in _by_rank(s):
        wait = r["collective_wait_ms_median"]
        assert wait["forward"] > 0 and wait["backward"] > 0 and wait["replicate"] == 0.0, r
        fsdp2 = r["memory"]["fsdp2"]
        full = fsdp2["estimated_full_bytes"]
        assert abs(fsdp2["local_shard_bytes"] - full / 2) <= 0.05 * full, fsdp2
        assert (fsdp2["shard_degree"], fsdp2["replicate_degree"]) == (2, None)
        # CPU: the device figures are not measured (null, never zero); RSS is
        assert fsdp2["peak_bytes_median"] is None and fsdp2["post_forward_bytes_median"] is None
        assert r["memory"]["rss_bytes"] > 0
    text = cli("summary", "--db", str(db)).stdout
    assert "FSDP2 (mesh replicate x shard" in text and "bwd wait" in text, text
    # compare reads the whole run its own way: the same verdict there
    compared = json.loads(cli("compare", str(db), str(db), "--json").stdout)
    assert [(v["name"], v["scope"].get("global_rank")) for v in compared["verdicts"]["a"]
            if v["name"] in STRAGGLERS] == [("COMPUTE_STRAGGLER", 1)], compared["verdicts"]


def test_balanced_fsdp2_job_names_no_straggler_and_says_the_deep_dive_was_skipped(tmp_path: Path) -> None:
    s, _, out = _run(tmp_path, 2, "--ms", "0", TRACEML_DEEP_DIVE="1", TRACEML_DEEP_DIVE_EVERY="1")
    assert _stragglers(s) == [], s["verdicts"]
    assert all(r["collective_wait_ms_median"]["backward"] is not None for r in s["ranks"])
    # one line per rank, a notice rather than an error
    assert out.count("[traceml] per-layer deep dive skipped: FSDPMLP is FSDP2") == 2, out
    assert s["delivery"]["agent_agent_errors"] == 0, s["delivery"]


def test_hsdp_names_the_slow_rank_and_reports_both_mesh_dimensions(tmp_path: Path) -> None:
    s, _, _ = _run(tmp_path, 4, "--hsdp", "--ms", "40", "--slow-rank", "2")
    strag = _stragglers(s)
    assert [(v["name"], v["scope"].get("global_rank")) for v in strag] == [("COMPUTE_STRAGGLER", 2)], s["verdicts"]
    for r in _by_rank(s):
        fsdp2 = r["memory"]["fsdp2"]
        assert (fsdp2["shard_degree"], fsdp2["replicate_degree"]) == (2, 2), fsdp2
        wait = r["collective_wait_ms_median"]
        assert wait["replicate"] > 0 and wait["shard"] > 0, r
    # Mesh (2, 2): rank 2 shards with rank 3 and is replicated on rank 0. Rank 3 waits for
    # it in the reduce-scatter (shard dim); ranks 0 and 1 in the all-reduce (replicate dim).
    ranks = _by_rank(s)
    assert ranks[3]["collective_wait_ms_median"]["shard"] - ranks[2]["collective_wait_ms_median"]["shard"] >= 20.0
    for r in (0, 1):
        assert ranks[r]["collective_wait_ms_median"]["replicate"] - ranks[2]["collective_wait_ms_median"][
            "replicate"] >= 20.0, ranks
