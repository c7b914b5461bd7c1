"""``traceml-daemon launch``: a real daemon and a real torchrun job from one
command, run as a subprocess with stdout captured (so never a terminal)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

from tests.support.procs import EXAMPLES, base_env, wait_for


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
