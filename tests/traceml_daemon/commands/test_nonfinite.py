"""A loss that goes NaN or infinite, through the real daemon: the summary names the
first step and rank (LOSS_NONFINITE) and compare calls the run divergent."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from tests.support.procs import DaemonProcess, base_env
from tests.traceml_daemon.wire_client import WireClient, agent_sender, peers_for, steps_body
from traceml_wire import messages
from traceml_wire.body import encode_body

STEPS = 40


def _losses(rank: int, bad_on_rank1: dict[int, float]) -> bytes:
    steps = list(range(STEPS))
    losses = [bad_on_rank1.get(s, 1.0 / (1 + s)) if rank == 1 else 1.0 / (1 + s) for s in steps]
    return encode_body({"scalars": {"step": steps, "name": ["loss"] * STEPS, "value": losses}})


def _write_run(db: Path, bad_on_rank1: dict[int, float], stats: dict[str, int] | None = None,
               rank2_body: bytes | None = None) -> None:
    """Ranks 0 and 1 step and log a loss (rank 1's bad at the steps given); ``rank2_body``: what
    a third rank sends."""
    with DaemonProcess(db) as daemon:
        with WireClient(daemon.port) as c:
            assert c.handshake("relay/s1/n0/1-r")["t"] == messages.ACCEPT
            items = []
            for rank in (0, 1):
                sender = agent_sender("s1", rank)
                items += [[sender, 1, steps_body(0, STEPS)], [sender, 2, _losses(rank, bad_on_rank1)]]
            if rank2_body is not None:
                items.append([agent_sender("s1", 2), 1, rank2_body])
            c.rbatch(1, items, peers_for(0, 1, 2) if rank2_body is not None else peers_for(0, 1), stats=stats)
            assert c.recv() == {"t": "ack", "seq": 1}
        if stats:  # a second relay whose counters add up past int64
            with WireClient(daemon.port) as c:
                assert c.handshake("relay/s1/n1/2-r")["t"] == messages.ACCEPT
                c.rbatch(1, [], {}, node={"node_rank": 1, "hostname": "h1"}, stats=stats)
                assert c.recv() == {"t": "ack", "seq": 1}
        assert daemon.stop() == 0


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "traceml_daemon", *args], capture_output=True, text=True,
                          env=base_env(), timeout=120)


def test_summary_names_the_first_nonfinite_loss_and_compare_calls_it_divergent(tmp_path: Path) -> None:
    bad, good = tmp_path / "bad.db", tmp_path / "good.db"
    _write_run(bad, {17: math.nan, 25: math.inf})
    _write_run(good, {})
    done = _cli("summary", "--db", str(bad), "--json", "--no-files")
    assert done.returncode == 0, done.stderr
    (verdict,) = [v for v in json.loads(done.stdout)["verdicts"] if v["name"] == "LOSS_NONFINITE"]
    assert verdict["scope"] == {"global_rank": 1} and verdict["severity"] == "critical"
    assert verdict["evidence"]["step"] == 17 and verdict["evidence"]["value"] == "NaN"
    assert not [v for v in json.loads(_cli("summary", "--db", str(good), "--json", "--no-files").stdout)["verdicts"]
                if v["name"] == "LOSS_NONFINITE"]
    compared = _cli("compare", str(good), str(bad), "--json")
    assert compared.returncode == 4, compared.stderr  # divergence detected
    result = json.loads(compared.stdout)
    (loss1,) = [s for s in result["scalars"]["series"] if s["name"] == "loss" and s["rank"] == 1]
    assert loss1["first_divergent_step"] == 17 and loss1["b"] == "nan"
    assert "LOSS_NONFINITE" in json.dumps(result["verdicts"])


def test_relay_counters_summed_past_int64_do_not_break_the_summary(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    _write_run(db, {}, stats={"dropped_batches": 2**62 + 1})
    done = _cli("summary", "--db", str(db), "--json", "--no-files")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["delivery"]["batches_dropped_reported"] == 2**63 - 1


def _strict(text: str) -> object:
    def refuse(token: str) -> object:
        raise AssertionError(f"not strict JSON: bare {token}")

    return json.loads(text, parse_constant=refuse)


def test_inspect_at_a_nan_step_with_a_peers_infinite_clock_prints_strict_json(tmp_path: Path) -> None:
    """The step where the loss went NaN is the one a user inspects; a peer that sent ts=inf
    for the same step (stored as such) must not stop the inspector either."""
    db = tmp_path / "run.db"
    row = {"step": [17], "ts": [math.inf], "step_ns": [20_000_000], "rss_bytes": [1 << 30]}
    _write_run(db, {17: math.nan}, rank2_body=encode_body({"steps": row}))
    text = _cli("inspect", "--db", str(db), "--step", "17")
    assert text.returncode == 0, text.stderr
    done = _cli("inspect", "--db", str(db), "--step", "17", "--json")
    assert done.returncode == 0, done.stderr
    view = _strict(done.stdout)
    assert isinstance(view, dict)
    by_rank = {r["global_rank"]: r for r in view["ranks"]}
    assert by_rank[1]["scalars"] == {"loss": "NaN"}
    assert by_rank[2]["models"][0]["ts"] == "+inf"
    summary = _cli("summary", "--db", str(db), "--json", "--no-files")
    assert summary.returncode == 0, summary.stderr
    _strict(summary.stdout)
