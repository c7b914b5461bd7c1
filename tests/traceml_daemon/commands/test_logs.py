"""Rank output through the real daemon: a 4-rank torchrun job whose rank 2 prints a
warning every step and raises; ``logs`` folds it across ranks, tracebacks first, and
the summary names rank 2 with its traceback. The relay runs standalone (as under
Slurm), so the ranks torchrun stops after the failure do not take it with them."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.procs import EXAMPLES, REPO, DaemonProcess, base_env, cli, free_port, summary, torchrun, wait_for

FAIL_AT = 20


@pytest.fixture(scope="module")
def failed_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, subprocess.CompletedProcess[str]]]:
    db = tmp_path_factory.mktemp("logs") / "job.db"
    with DaemonProcess(db) as daemon:
        relay_port = free_port()
        relay = subprocess.Popen(
            [sys.executable, "-m", "relay", "--port", str(relay_port), "--daemon", daemon.address,
             "--session", "failjob", "--spool-dir", str(db.parent / "spool")],
            cwd=REPO, env=base_env(), stderr=subprocess.PIPE, text=True,
        )
        try:
            assert relay.stderr is not None and "listening" in relay.stderr.readline()
            env = base_env(TRACEML_DAEMON=daemon.address, TRACEML_RELAY_PORT=str(relay_port), TRACEML_NO_RELAY="1",
                           TRACEML_FLUSH_S="0.2", TORCHELASTIC_RUN_ID="failjob")
            done = torchrun(EXAMPLES / "scenarios" / "rank_failure.py", ["--fail-at", str(FAIL_AT)], nproc=4, env=env)
            wait_for(lambda: (summary(db) or {}).get("failure"), 60, what="the failure in the summary")
            yield db, done
        finally:
            relay.terminate()
            relay.wait(30)


def _logs(db: Path, *args: str) -> dict[str, Any]:
    done = cli("logs", "--db", str(db), "--json", *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_job_failed_and_its_console_output_is_unchanged(failed_job: tuple[Path, Any]) -> None:
    _, done = failed_job
    assert done.returncode != 0
    # The tee passes every line on: torchrun's console still shows them.
    assert done.stdout.count("training: epoch 0 in progress") >= 3 * (FAIL_AT + 1)
    assert "RuntimeError: rank 2 lost its data shard at step 20" in done.stdout + done.stderr


def test_logs_fold_identical_lines_across_ranks_tracebacks_first(failed_job: tuple[Path, Any]) -> None:
    db, _ = failed_job
    entries = _logs(db)["entries"]
    assert entries[0]["kind"] == "traceback" and entries[0]["ranks"] == [2], entries[0]
    assert entries[0]["text"].endswith("RuntimeError: rank 2 lost its data shard at step 20")
    warning = [e for e in entries if e["text"] == "warning: gradient norm is large on this rank"]
    assert len(warning) == 1
    assert (warning[0]["kind"], warning[0]["ranks"], warning[0]["count"]) == ("warning", [2], FAIL_AT + 1)
    progress = [e for e in entries if e["text"] == "training: epoch 0 in progress"]
    assert len(progress) == 1
    assert (progress[0]["ranks"], progress[0]["ranks_text"], progress[0]["count"]) == ([0, 1, 2, 3], "0-3", 4 * (FAIL_AT + 1))
    kinds = [e["kind"] for e in entries]
    assert kinds.index("warning") < kinds.index("line")

    text = cli("logs", "--db", str(db)).stdout
    assert "[ranks 0-3 x84] training: epoch 0 in progress" in text
    assert "[rank 2 x21] warning: gradient norm is large on this rank" in text
    assert text.index("Traceback (most recent call last):") < text.index("[ranks 0-3 x84]")


def test_logs_filters_by_rank_and_pattern(failed_job: tuple[Path, Any]) -> None:
    db, _ = failed_job
    only = _logs(db, "--rank", "1")["entries"]
    # Rank 1 may also print a traceback, when its barrier finds rank 2 gone before torchrun stops it.
    assert {tuple(e["ranks"]) for e in only} == {(1,)}
    lines = [(e["text"], e["count"]) for e in only if e["kind"] != "traceback"]
    assert lines == [("training: epoch 0 in progress", FAIL_AT + 1)]
    grep = _logs(db, "--grep", "gradient")["entries"]
    assert [e["text"] for e in grep] == ["warning: gradient norm is large on this rank"]
    bad = cli("logs", "--db", str(db), "--rank", "9")
    assert bad.returncode == 2 and "rank 9 is not in session" in bad.stderr and "(ranks 0-3)" in bad.stderr
    bad = cli("logs", "--db", str(db), "--grep", "(")
    assert bad.returncode == 2 and "--grep" in bad.stderr


def test_the_summary_names_the_first_rank_that_failed_with_its_traceback(failed_job: tuple[Path, Any]) -> None:
    db, _ = failed_job
    s = summary(db)
    assert s is not None
    failure = s["failure"]
    # The others fail after it, when their collective finds rank 2 gone.
    assert failure["global_rank"] == 2 and 2 in failure["ranks_with_traceback"]
    assert failure["exception"] == "RuntimeError: rank 2 lost its data shard at step 20"
    assert failure["traceback"][0] == "Traceback (most recent call last):"
    assert failure["last_lines"][-1] == failure["exception"]
    text = cli("summary", "--db", str(db), "--no-files").stdout
    assert "First failure: rank 2: RuntimeError: rank 2 lost its data shard at step 20" in text


def test_follow_prints_lines_stored_after_it_started(failed_job: tuple[Path, Any], tmp_path: Path) -> None:
    db, _ = failed_job
    copy = tmp_path / "copy.db"
    src = sqlite3.connect(db)
    src.backup(dst := sqlite3.connect(copy))  # a database this test may write to, as a daemon would
    src.close()
    ranks = dict(dst.execute("SELECT global_rank, rank_id FROM ranks").fetchall())
    follow = subprocess.Popen([sys.executable, "-m", "traceml_daemon", "logs", "--db", str(copy), "--follow", "--json",
                               "--grep", "late|training"], env=base_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert follow.stdout is not None
        # The report of what is stored comes first: once it is out, follow has its start.
        assert json.loads(follow.stdout.readline())["text"] == "training: epoch 0 in progress"
        dst.executemany("INSERT INTO output (rank_id, ts, stream, seq, line) VALUES (?, ?, 'stdout', ?, ?)",
                        [(ranks[g], 2e9, 10_000, "late line") for g in (0, 1)] + [(ranks[3], 2e9, 10_001, "other")])
        dst.commit()
        entry = json.loads(follow.stdout.readline())
        assert (entry["text"], entry["ranks"], entry["count"]) == ("late line", [0, 1], 2)
    finally:
        follow.terminate()
        follow.wait(30)
        dst.close()
