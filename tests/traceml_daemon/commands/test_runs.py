"""Two jobs on one daemon: ``runs`` lists both, every reader takes ``--session``.

The database is written by the real daemon from two relays of different
sessions whose batches alternate (``two_jobs``); each reader is then asked
for one job and must show that job's ranks and steps only.
"""

from __future__ import annotations

import csv
import json
import shutil
import sqlite3
from pathlib import Path

import pytest

from tests.support.procs import DaemonProcess, cli
from tests.traceml_daemon.commands.two_jobs import JOB_A, JOB_B, send_interleaved
from traceml_daemon.commands import cli as cli_module
from traceml_daemon.tui.app import main as tui_main

RUN_FIELDS = {"session", "attempt", "attempts", "first_seen", "last_seen", "ranks", "nodes", "first_step",
              "last_step", "state", "live", "latest", "verdicts", "verdict_names", "verdicts_steps"}


@pytest.fixture(scope="module")
def two_jobs_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    db = tmp_path_factory.mktemp("two_jobs") / "head.db"
    with DaemonProcess(db) as daemon:
        send_interleaved(daemon.port)
        assert daemon.stop() == 0
    return db


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli_module.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_runs_lists_both_jobs_with_their_fields(two_jobs_db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "runs", "--db", str(two_jobs_db), "--json")
    assert code == 0, err
    listing = json.loads(out)
    assert listing["latest"] == JOB_B.session  # its ranks were stored after job A's
    assert "newest steps" in listing["verdicts_from"]
    runs = {r["session"]: r for r in listing["runs"]}
    assert list(runs) == [JOB_A.session, JOB_B.session]  # oldest first
    for job in (JOB_A, JOB_B):
        run = runs[job.session]
        assert set(run) == RUN_FIELDS
        assert (run["attempts"], run["ranks"], run["nodes"]) == ([0], job.ranks, 1)
        assert (run["first_step"], run["last_step"]) == (0, job.steps - 1)
        assert run["first_seen"] <= run["last_seen"]
        assert isinstance(run["verdicts"], int) and len(run["verdict_names"]) == run["verdicts"]
        assert run["latest"] == (job is JOB_B)
    assert runs[JOB_A.session]["state"] == "finished"  # its last batch said every rank finished
    assert runs[JOB_B.session]["state"] in ("live", "stopped")

    code, out, _ = run_cli(capsys, "runs", "--db", str(two_jobs_db))
    assert code == 0
    lines = out.splitlines()
    row_a = next(line for line in lines if JOB_A.session in line)
    row_b = next(line for line in lines if JOB_B.session in line)
    assert row_b.startswith("*") and not row_a.startswith("*")
    assert "0-29" in row_a and "finished" in row_a and "0-39" in row_b
    assert "summary --session ID" in lines[-1]

    code, out, _ = run_cli(capsys, "runs", "--db", str(two_jobs_db), "--json", "--no-verdicts")
    assert code == 0
    assert all(r["verdicts"] is None for r in json.loads(out)["runs"])


def test_summary_session_shows_only_that_jobs_ranks_and_steps(two_jobs_db: Path) -> None:
    for job in (JOB_A, JOB_B):
        done = cli("summary", "--db", str(two_jobs_db), "--json", "--no-files", "--session", job.session)
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout)
        assert out["session"] == job.session and out["topology"]["world_size"] == job.ranks
        assert [r["global_rank"] for r in out["ranks"]] == list(range(job.ranks))
        assert {r["hostname"] for r in out["ranks"]} == {job.hostname}
        assert {(r["steps"], r["first_step"], r["last_step"]) for r in out["ranks"]} == {(job.steps, 0, job.steps - 1)}
        assert {r["step_ms_median"] for r in out["ranks"]} == {float(job.step_ms)}
    # Without --session: the latest run.
    done = cli("summary", "--db", str(two_jobs_db), "--json", "--no-files")
    assert done.returncode == 0 and json.loads(done.stdout)["session"] == JOB_B.session


def test_an_unknown_session_names_the_sessions_there(two_jobs_db: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    done = cli("summary", "--db", str(two_jobs_db), "--session", "job-z", "--no-files")
    assert done.returncode == 2
    assert "no session 'job-z'" in done.stderr and JOB_A.session in done.stderr and JOB_B.session in done.stderr
    db = str(two_jobs_db)
    for argv in (
        ("compare", f"{db}:job-z", db),
        ("compare", db, db, "--session", "job-z"),
        ("export", "--db", db, "--format", "csv", str(tmp_path / "x.csv"), "--session", "job-z"),
    ):
        code, _, err = run_cli(capsys, *argv)
        assert code == 2, argv
        assert "no session 'job-z' in the database" in err and JOB_A.session in err and JOB_B.session in err
    assert tui_main(["--db", db, "--session", "job-z"]) == 2
    err = capsys.readouterr().err
    assert "no session 'job-z'" in err and JOB_A.session in err


def test_compare_takes_path_colon_session_on_either_side(two_jobs_db: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    db = str(two_jobs_db)
    code, out, err = run_cli(capsys, "compare", f"{db}:{JOB_A.session}", f"{db}:{JOB_B.session}", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert (result["a"]["session"], result["a"]["ranks"], result["a"]["path"]) == (JOB_A.session, JOB_A.ranks, db)
    assert (result["b"]["session"], result["b"]["ranks"]) == (JOB_B.session, JOB_B.ranks)
    step = next(row for row in result["deltas"] if row["metric"] == "step")
    assert (step["a_ms"], step["b_ms"]) == (float(JOB_A.step_ms), float(JOB_B.step_ms))

    # A path holding ':' that exists as a file is that file; a session id may hold ':' too.
    odd = tmp_path / "head:copy.db"
    shutil.copy(two_jobs_db, odd)
    code, out, err = run_cli(capsys, "compare", str(odd), f"{odd}:{JOB_A.session}", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert (result["a"]["path"], result["a"]["session"]) == (str(odd), JOB_B.session)  # the latest
    assert (result["b"]["path"], result["b"]["session"]) == (str(odd), JOB_A.session)
    code, out, err = run_cli(capsys, "compare", f"{odd}:{JOB_B.session}", db, "--session", JOB_A.session)
    assert code == 0, err
    assert out.startswith(f"A: {odd} session {JOB_B.session} attempt 0\nB: {db} session {JOB_A.session} attempt 0\n")


def test_export_session_exports_only_that_run(two_jobs_db: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    db = str(two_jobs_db)
    for job, argv in ((JOB_A, ("--session", JOB_A.session)), (JOB_B, ())):  # no --session: the latest
        out = tmp_path / f"{job.ranks}.csv"
        code, _, err = run_cli(capsys, "export", "--db", db, "--format", "csv", str(out), *argv)
        assert code == 0, err
        with open(out, newline="") as fh:
            rows = list(csv.DictReader(fh))
        assert {r["session"] for r in rows} == {job.session}
        assert len(rows) == job.ranks * job.steps
    out = tmp_path / "a.json"
    code, _, err = run_cli(capsys, "export", "--db", db, "--format", "chrome", str(out), "--session", JOB_A.session)
    assert code == 0, err
    trace = json.loads(out.read_text())
    assert trace["metadata"]["sessions"] == [JOB_A.session]
    lanes = [e for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert len(lanes) == JOB_A.ranks and all(JOB_A.hostname in e["args"]["name"] for e in lanes)
    code, _, err = run_cli(capsys, "export", "--db", db, "--format", "csv", str(tmp_path / "all.csv"),
                           "--all-sessions")
    assert code == 0, err
    assert f"from {JOB_A.ranks + JOB_B.ranks} ranks" in err


def test_the_daemon_stored_the_two_jobs_apart(two_jobs_db: Path) -> None:
    con = sqlite3.connect(f"file:{two_jobs_db}?mode=ro", uri=True)
    try:
        rows = con.execute("SELECT session, count(*) FROM ranks GROUP BY session ORDER BY session").fetchall()
    finally:
        con.close()
    assert sorted(rows) == sorted([(JOB_A.session, JOB_A.ranks), (JOB_B.session, JOB_B.ranks)])
