"""Policy files (``--policy FILE``): every threshold settable, every mistake named, and the
verdicts of the real daemon's final summary, of ``summary`` and of ``/metrics`` follow them."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.procs import DaemonProcess, base_env
from tests.traceml_daemon.wire_client import WireClient, agent_sender, steps_body
from traceml_daemon.analysis.policy import DEFAULT_POLICY, Policy
from traceml_daemon.analysis.policy_file import (
    PolicyFileError,
    load_policy,
    policy_from_toml,
    policy_overrides,
)
from traceml_wire import messages


def _toml_value(value: Any) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(json.dumps(v) for v in value) + "]"
    return repr(value)


def test_every_policy_field_can_be_set_from_a_file() -> None:
    # Each field written out at its default reads back as the default policy: no field a file cannot set.
    lines: list[str] = []
    for section in dataclasses.fields(Policy):
        lines.append(f"[{section.name}]")
        values = getattr(DEFAULT_POLICY, section.name)
        lines += [f"{f.name} = {_toml_value(getattr(values, f.name))}" for f in dataclasses.fields(values)]
    assert policy_from_toml("\n".join(lines)) == DEFAULT_POLICY


def test_a_file_overrides_only_what_it_names() -> None:
    policy = policy_from_toml(
        "[stragglers]\nmin_excess_frac = 0.25\nmin_excess_ms = 3  # an integer for a float field\n"
        '[steps]\nwarmup_steps = 50\nrequired_phases = ["forward"]\n'
    )
    assert policy.stragglers == dataclasses.replace(DEFAULT_POLICY.stragglers, min_excess_frac=0.25, min_excess_ms=3.0)
    assert isinstance(policy.stragglers.min_excess_ms, float)
    assert policy.steps.warmup_steps == 50 and policy.steps.required_phases == ("forward",)
    assert policy.memory == DEFAULT_POLICY.memory
    assert policy_overrides(policy) == {
        "steps": {"warmup_steps": 50, "required_phases": ["forward"]},
        "stragglers": {"min_excess_ms": 3.0, "min_excess_frac": 0.25},
    }
    assert policy_overrides(DEFAULT_POLICY) == {} and policy_from_toml("") == DEFAULT_POLICY


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[straglers]\nmin_excess_frac = 0.2", ["unknown section [straglers]", "[stragglers]", "[memory]"]),
        ("[stragglers]\nmin_excess = 0.2", ["unknown key 'min_excess' in [stragglers]", "min_excess_frac",
                                             "min_excess_ms"]),
        ("min_excess_frac = 0.2", ["unknown section [min_excess_frac]", "valid sections"]),
        ("stragglers = 3", ["stragglers must be a section", "an integer"]),
        ('[stragglers]\nmin_excess_frac = "0.2"', ["stragglers.min_excess_frac must be a number", "a string"]),
        ("[memory]\ncreep_min_frac = true", ["memory.creep_min_frac must be a number", "a boolean"]),
        ("[steps]\nwindow = 1.5", ["steps.window must be a whole number", "a float (1.5)"]),
        ("[steps]\nmin_steps = 0", ["steps.min_steps must be at least 1"]),
        ("[memory]\ncreep_segments = 1", ["memory.creep_segments must be at least 2"]),
        ("[system]\nhot_gpu_c = -1.0", ["system.hot_gpu_c must be a finite number, not negative"]),
        ("[system]\nhot_gpu_c = inf", ["system.hot_gpu_c must be a finite number"]),
        ('[steps]\nrequired_phases = ["fwd"]', ["unknown phase 'fwd'", "forward"]),
        ("[steps]\nrequired_phases = \"forward\"", ["steps.required_phases must be a list of phase names"]),
        ("[steps\nwindow = 3", ["is not valid TOML"]),
    ],
)
def test_mistakes_are_errors_naming_the_key_and_the_valid_ones(text: str, expected: list[str]) -> None:
    with pytest.raises(PolicyFileError) as err:
        policy_from_toml(text, "site.toml")
    message = str(err.value)
    assert message.startswith("site.toml"), message
    for part in expected:
        assert part in message, message


def test_unreadable_files_are_errors(tmp_path: Path) -> None:
    with pytest.raises(PolicyFileError, match="cannot read policy file"):
        load_policy(str(tmp_path / "missing.toml"))
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b"# caf\xe9\n")
    with pytest.raises(PolicyFileError, match="not UTF-8"):
        load_policy(str(latin))


# ------------------------------------------------------------ through the real daemon and CLI


def _write_straggler_run(db: Path, *serve_args: str) -> DaemonProcess:
    """2 nodes x 2 ranks through two relays, rank 3 twice as slow (WAIT_STRAGGLER, critical
    by default: its excess is the others' whole step); the daemon stopped cleanly."""
    daemon = DaemonProcess(db, args=serve_args)
    with daemon:
        for node in (0, 1):
            with WireClient(daemon.port) as c:
                assert c.handshake(f"relay/s1/n{node}/9-r")["t"] == messages.ACCEPT
                items, peers = [], {}
                for local in (0, 1):
                    rank = node * 2 + local
                    sender = agent_sender("s1", rank, node=node)
                    items.append([sender, 1, steps_body(0, 20, step_ns=40_000_000 if rank == 3 else 20_000_000)])
                    peers[sender] = {"global_rank": rank, "local_rank": local, "node_rank": node, "world_size": 4,
                                     "nnodes": 2, "hostname": f"host{node}", "parallelism": "ddp"}
                c.rbatch(1, items, peers, node={"node_rank": node, "hostname": f"host{node}"})
                assert c.recv() == {"t": "ack", "seq": 1}
        assert daemon.stop() == 0, daemon.log()
    return daemon


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "traceml_daemon", *args], capture_output=True, text=True,
                          env=base_env(), timeout=120)


def _stragglers(summary: dict[str, Any]) -> list[tuple[str, str, int | None]]:
    return [(v["name"], v["severity"], v["scope"].get("global_rank"))
            for v in summary["verdicts"] if v["name"].endswith("STRAGGLER")]


@pytest.fixture(scope="module")
def run_db(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """One run written by a daemon serving ``--policy`` (critical only from twice the others' step):
    the database and the final_summary.json that daemon wrote when it stopped."""
    folder = tmp_path_factory.mktemp("policy_run")
    serve_policy = folder / "serve.toml"
    serve_policy.write_text("[stragglers]\ncritical_excess_frac = 2.0\n")
    db = folder / "run.db"
    _write_straggler_run(db, "--policy", str(serve_policy))
    return db, folder / "final_summary.json"


def test_serve_policy_makes_the_final_summary(run_db: tuple[Path, Path]) -> None:
    _, final = run_db
    written = json.loads(final.read_text())
    assert _stragglers(written) == [("WAIT_STRAGGLER", "warn", 3)]
    assert written["policy_overrides"] == {"stragglers": {"critical_excess_frac": 2.0}}


def test_summary_policy_moves_the_threshold_and_the_verdict_with_it(run_db: tuple[Path, Path], tmp_path: Path) -> None:
    db, _ = run_db
    default = _cli("summary", "--db", str(db), "--json", "--no-files")
    assert default.returncode == 0, default.stderr
    assert _stragglers(json.loads(default.stdout)) == [("WAIT_STRAGGLER", "critical", 3)]

    # The excess (20 ms) is the others' whole step: under a 150% bar rank 3 is no straggler.
    higher = tmp_path / "higher.toml"
    higher.write_text("[stragglers]\nmin_excess_frac = 1.5\n")
    done = _cli("summary", "--db", str(db), "--json", "--no-files", "--policy", str(higher))
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert _stragglers(out) == [] and out["policy_overrides"] == {"stragglers": {"min_excess_frac": 1.5}}

    milder = tmp_path / "milder.toml"
    milder.write_text("[stragglers]\ncritical_excess_frac = 2.0\n")
    done = _cli("summary", "--db", str(db), "--no-files", "--policy", str(milder))
    assert done.returncode == 0, done.stderr
    assert "[WARN] WAIT_STRAGGLER (rank 3, node 1)" in done.stdout
    assert "thresholds changed by --policy: stragglers.critical_excess_frac=2.0" in done.stdout


def test_metrics_verdicts_follow_the_policy(run_db: tuple[Path, Path]) -> None:
    from traceml_daemon.metrics.collect import read_db_state

    db, _ = run_db
    ids = set(range(1, 5))
    assert {(v.name, v.severity) for v in read_db_state(str(db), ids).verdicts} >= {("WAIT_STRAGGLER", "critical")}
    policy = policy_from_toml("[stragglers]\nmin_excess_frac = 1.5\n")
    assert not [v for v in read_db_state(str(db), ids, policy).verdicts if v.name.endswith("STRAGGLER")]


def test_a_bad_policy_file_is_exit_2_naming_the_key(run_db: tuple[Path, Path], tmp_path: Path) -> None:
    db, _ = run_db
    bad = tmp_path / "bad.toml"
    bad.write_text("[stragglers]\nmin_excess = 0.2\n")
    wrong_type = tmp_path / "type.toml"
    wrong_type.write_text("[steps]\nwarmup_steps = \"five\"\n")
    for args, policy, words in (
        (["summary", "--db", str(db), "--no-files"], bad, ["unknown key 'min_excess' in [stragglers]",
                                                          "valid keys: critical_excess_frac"]),
        (["summary", "--db", str(db), "--no-files"], wrong_type, ["steps.warmup_steps must be a whole number"]),
        (["summary", "--db", str(db), "--no-files"], tmp_path / "missing.toml", ["cannot read policy file"]),
        # serve refuses before it listens or opens the database.
        (["serve", "--port", "0", "--db", str(tmp_path / "never.db")], bad, ["unknown key 'min_excess'"]),
        (["tui", "--db", str(db)], bad, ["unknown key 'min_excess'"]),
    ):
        done = _cli(*args, "--policy", str(policy))
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        for word in (str(policy), *words):
            assert word in done.stderr, (args, done.stderr)
    assert not (tmp_path / "never.db").exists()


def test_the_diagnosis_page_lists_every_verdict_and_every_threshold() -> None:
    from traceml_daemon.analysis.report import PRIORITY

    page = (Path(__file__).resolve().parents[3] / "docs" / "diagnosis.md").read_text()
    # Each verdict has a section: its name in a heading, so the page is searched by name.
    headings = " ".join(line for line in page.splitlines() if line.startswith("## ")).replace(",", " ")
    for name in (*PRIORITY, "DIAGNOSIS_ERROR", "REGRESSION", "IMPROVEMENT"):
        assert name in headings.split(), name
    for section in dataclasses.fields(Policy):
        assert f"`[{section.name}]`" in page, section.name
        for f in dataclasses.fields(getattr(DEFAULT_POLICY, section.name)):
            assert f"`{f.name}`" in page, f"{section.name}.{f.name}"
