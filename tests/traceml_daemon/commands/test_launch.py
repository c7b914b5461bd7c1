"""``traceml-daemon launch``: a real daemon and a real torchrun job from one
command, run as a subprocess with stdout captured (so never a terminal); its
flag checks through the real CLI; what node 0 of a multi-node run waits for."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.procs import EXAMPLES, DaemonProcess, base_env, wait_for, wait_for_steps
from traceml_daemon.commands.launch import pending_nodes
from traceml_daemon.store.migrate import migrate


def launch(*args: str, cwd: Path, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "traceml_daemon", "launch", *args], cwd=cwd, env=base_env(),
                          capture_output=True, text=True, timeout=timeout)


def test_launch_runs_the_job_and_prints_the_summary(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    done = launch("--nproc-per-node", "2", "--db", str(db), "--", str(EXAMPLES / "train.py"), "--steps", "12",
                  cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "TraceML summary" in done.stdout
    table = done.stdout.split("Ranks", 1)[1].split("Nodes", 1)[0]
    ranks = [line.split() for line in table.splitlines() if re.match(r"^\s+\d+\s+\d+\s", line)]
    assert [(r[0], r[4]) for r in ranks] == [("0", "12"), ("1", "12")]  # rank, steps
    # The daemon was stopped cleanly: it drained and wrote the final summary beside the db.
    final = json.loads((tmp_path / "final_summary.json").read_text())
    assert [r["global_rank"] for r in final["ranks"]] == [0, 1]
    assert final["topology"]["world_size"] == 2


def test_launch_exits_with_the_scripts_exit_code(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import sys\nsys.exit(3)\n")
    done = launch("--nproc-per-node", "2", "--db", str(tmp_path / "run.db"), "--", str(script), cwd=tmp_path)
    assert done.returncode == 3, done.stdout + done.stderr


def test_launch_usage_errors_are_clear_and_exit_2(tmp_path: Path) -> None:
    missing = launch("--", str(tmp_path / "nope.py"), cwd=tmp_path, timeout=60)
    assert missing.returncode == 2
    assert "nope.py not found" in missing.stderr
    assert "Traceback" not in missing.stderr
    no_dashes = launch(str(EXAMPLES / "train.py"), cwd=tmp_path, timeout=60)
    assert no_dashes.returncode == 2
    assert "after `--`" in no_dashes.stderr
    assert not (tmp_path / "traceml.db").exists()  # nothing was started


def _gone(pid: int) -> bool:
    """Exited (or a zombie nobody reaped yet: it runs no code any more)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_ctrl_c_stops_the_job_and_the_daemon(tmp_path: Path) -> None:
    script = tmp_path / "forever.py"
    script.write_text(
        "import os, sys, time\n"
        "open(os.path.join(sys.argv[1], f'{os.getpid()}.pid'), 'w').close()\n"
        "time.sleep(3600)\n"
    )
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "traceml_daemon", "launch", "--nproc-per-node", "2", "--db", str(tmp_path / "run.db"),
         "--", str(script), str(pids_dir)],
        cwd=tmp_path, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # A foreground process at a terminal gets Ctrl-C. Started from a background job
        # (`cmd &` in a script), pytest and its children inherit SIGINT ignored, and the
        # launcher rightly keeps ignoring it: give it the disposition a terminal would.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        pids = wait_for(lambda: [int(p.stem) for p in pids_dir.glob("*.pid")] if len(list(pids_dir.glob("*.pid"))) == 2
                        else None, timeout=120, what="both ranks running")
        proc.send_signal(signal.SIGINT)  # what Ctrl-C delivers to the foreground process
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    port = int(re.search(r"daemon on 127\.0\.0\.1:(\d+)", err).group(1))  # type: ignore[union-attr]
    assert wait_for(lambda: all(_gone(p) for p in pids), timeout=30, what="ranks stopped")
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0  # the daemon is gone too
    assert os.path.exists(tmp_path / "run.db")


def _usage(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return launch(*args, "--", str(EXAMPLES / "train.py"), cwd=tmp_path, timeout=60)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--nnodes", "2", "--node-rank", "1"], "--node-rank 1 needs --master-addr HOST: node 0's address"),
        (["--nnodes", "2", "--node-rank", "2", "--master-addr", "head"],
         "--node-rank 2 is not below --nnodes 2: node ranks run from 0 to 1"),
        (["--node-rank", "1"], "--node-rank 1 needs --nnodes: a multi-node run gives every node the same --nnodes"),
        (["--nnodes", "2", "--master-addr", "head"], "a multi-node run needs a shared token"),
        (["--nnodes", "2", "--master-addr", "head", "--token-file", "missing-token"],
         "cannot read --token-file missing-token"),
        (["--nnodes", "2", "--master-addr", "head", "--token-file", "{empty}"], "is empty; create one with"),
        (["--master-addr", "head"], "are the rendezvous of a multi-node run: add --nnodes N"),
        (["--master-port", "29500"], "are the rendezvous of a multi-node run"),
        (["--nnodes", "2", "--master-addr", "head", "--token-file", "{token}", "--port", "0"],
         "--port 0 across nodes: the other nodes could not know the port"),
        (["--nnodes", "2", "--master-addr", "head", "--token-file", "{token}", "--master-port", "0"],
         "--master-port 0: the other nodes could not know the port"),
        (["--daemon", "head"], "--daemon 'head' is not HOST:PORT"),
        (["--daemon", "head:29765", "--port", "1234"], "with --daemon give HOST:PORT of the running one and drop --port"),
        (["--daemon", "10.1.2.3:29765"], "requires a token"),
        (["--db", "no/such/dir/run.db"], "directory of --db no/such/dir/run.db does not exist"),
        (["--nnodes", "0"], "argument --nnodes: 0 is below 1"),
        (["--node-rank", "-1"], "argument --node-rank: -1 is below 0"),
        (["--nnodes", "2", "--master-addr", "head", "--token-file", "{token}", "--master-port", "70000"],
         "argument --master-port: 70000 is not a port number"),
    ],
)
def test_launch_flag_mistakes_name_the_fix_and_exit_2(tmp_path: Path, flags: list[str], says: str) -> None:
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "token").write_text("secret\n")
    flags = [f.format(empty=tmp_path / "empty", token=tmp_path / "token") for f in flags]
    done = _usage(tmp_path, *flags)
    assert done.returncode == 2, done.stdout + done.stderr
    assert says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert "secret" not in done.stderr
    assert not (tmp_path / "traceml.db").exists()  # nothing was started
    assert not (tmp_path / "traceml-daemon.log").exists()


def test_launch_with_daemon_sends_there_and_starts_none(tmp_path: Path) -> None:
    db = tmp_path / "elsewhere.db"
    with DaemonProcess(db).start() as daemon:
        done = launch("--daemon", daemon.address, "--", str(EXAMPLES / "train.py"), "--steps", "6", cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr
        s = wait_for_steps(db, ranks=1, steps=6)
    assert s["topology"]["world_size"] == 1
    assert f"sending to the daemon at {daemon.address}" in done.stderr
    assert "its node holds the database and the summary" in done.stderr
    assert "TraceML summary" not in done.stdout
    assert not (tmp_path / "traceml.db").exists() and not (tmp_path / "traceml-daemon.log").exists()


def _rank(conn: sqlite3.Connection, rank_id: int, node: int, *, first_seen: float, last_seen: float,
          finished: bool | None, attempt: int = 0, local_world: int = 2) -> None:
    conn.execute("INSERT INTO ranks (rank_id, sender, session, attempt, global_rank, node_rank, local_world_size, "
                 "first_seen, last_seen) VALUES (?, ?, 's', ?, ?, ?, ?, ?, ?)",
                 (rank_id, f"s/a{attempt}/n{node}/r{rank_id}", attempt, rank_id, node, local_world, first_seen,
                  last_seen))
    if finished is not None:
        conn.execute("INSERT INTO status (rank_id, ts, phase, phase_since, step, steps_done, finished) "
                     "VALUES (?, ?, 'idle', ?, 1, 1, ?)", (rank_id, last_seen, last_seen, int(finished)))


def test_pending_nodes_counts_this_runs_ranks_of_the_other_nodes(tmp_path: Path) -> None:
    """What node 0 waits for: every rank of nodes 1.. in this run, each having sent its last batch."""
    db = str(tmp_path / "run.db")
    assert pending_nodes(db, since=100.0, nnodes=3) == ([1, 2], 0.0)  # no database yet
    migrate(db)
    assert pending_nodes(db, since=100.0, nnodes=3) == ([1, 2], 0.0)
    with sqlite3.connect(db) as conn:
        _rank(conn, 1, 1, first_seen=50.0, last_seen=60.0, finished=True)  # an older run in the same file
        _rank(conn, 2, 1, first_seen=50.0, last_seen=60.0, finished=True)
        _rank(conn, 3, 0, first_seen=101.0, last_seen=200.0, finished=False)  # node 0's own: never waited for
        _rank(conn, 4, 1, first_seen=101.0, last_seen=150.0, finished=True)
        _rank(conn, 5, 2, first_seen=101.0, last_seen=140.0, finished=True)
        _rank(conn, 6, 2, first_seen=101.0, last_seen=145.0, finished=None)  # no status yet
    assert pending_nodes(db, since=100.0, nnodes=3) == ([1, 2], 150.0)  # node 1: one of its two ranks so far
    with sqlite3.connect(db) as conn:
        _rank(conn, 7, 1, first_seen=102.0, last_seen=160.0, finished=True)
        conn.execute("INSERT INTO status (rank_id, ts, phase, phase_since, step, steps_done, finished) "
                     "VALUES (6, 170.0, 'idle', 170.0, 9, 9, 1)")
        conn.execute("UPDATE ranks SET last_seen = 170.0 WHERE rank_id = 6")
    assert pending_nodes(db, since=100.0, nnodes=3) == ([], 170.0)
    with sqlite3.connect(db) as conn:
        # A restarted worker group on node 2: its new attempt is what must finish now.
        _rank(conn, 8, 2, first_seen=180.0, last_seen=180.0, finished=False, attempt=1)
        _rank(conn, 9, 2, first_seen=180.0, last_seen=181.0, finished=True, attempt=1)
    assert pending_nodes(db, since=100.0, nnodes=3) == ([2], 181.0)
