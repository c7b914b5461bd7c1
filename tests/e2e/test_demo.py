"""``traceml-daemon demo`` end to end: a real daemon and two real torchrun
"nodes" (2 ranks each, gloo on CPU), started by the demo itself.

Besides its summary, the demo promises to leave nothing running: its children
live in sessions of their own (so a whole torchrun tree can be signalled), which
also means no signal reaches them unless the demo forwards it. Leftovers are
looked for in two ways: the demo's descendants recorded while it ran must all be
gone, and no live process may carry the demo's session (``TRACEML_SESSION=
demo-<pid>``, in every child's environment) or the test's directory (the db,
and TMPDIR, under which the demo puts its logs) in its command line.
"""

from __future__ import annotations

import fcntl
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.support.procs import base_env, summary, wait_for

pytestmark = pytest.mark.slow

LONG_RUN = 5000  # steps: far more than a test waits for, so the job is mid-run when signalled


def demo_command(db: Path, steps: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "traceml_daemon", "demo", "--steps", str(steps), "--db", str(db), *extra]


def demo_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    # The demo's log folder (tempfile.mkdtemp) and torchrun's scratch folders land in tmp_path.
    return base_env(TMPDIR=str(tmp_path), **extra)


def _alive(proc: psutil.Process) -> bool:
    try:
        # is_running() also checks the start time, so a reused pid is not mistaken for it.
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def leftovers(demo_pid: int, folder: Path) -> list[str]:
    """Live processes started for the demo with this pid, described for the assertion message."""
    session, marker, me = f"demo-{demo_pid}", str(folder), os.getpid()
    found = []
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            cmdline = " ".join(proc.cmdline())
            if marker in cmdline or proc.environ().get("TRACEML_SESSION") == session:
                found.append(f"{proc.pid}: {cmdline}")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def job_processes(kids: list[psutil.Process]) -> dict[str, int]:
    """How many of the demo's descendants are the daemon, torchrun agents and ranks."""
    lines = [_cmdline(p) for p in kids]
    return {
        "daemon": sum("traceml_daemon serve" in c for c in lines),
        "torchrun": sum("torch.distributed.run" in c for c in lines),
        "ranks": sum("train.py" in c and "torch.distributed.run" not in c for c in lines),
    }


@pytest.fixture
def reap() -> Iterator[list[psutil.Process]]:
    """Processes a failed test must not leave behind (the demo and what it started)."""
    procs: list[psutil.Process] = []
    yield procs
    for proc in procs:
        if _alive(proc):
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass


def running_demo(proc: subprocess.Popen[Any], db: Path, reap: list[psutil.Process]) -> list[psutil.Process]:
    """Wait until all 4 ranks stored a step; return the demo's descendants then."""
    reap.append(psutil.Process(proc.pid))

    def started() -> bool:
        assert proc.poll() is None, f"the demo exited early with {proc.returncode}"
        return wait_for_steps_now(db)

    wait_for(started, timeout=240, interval=0.5, what="4 ranks with a stored step")
    kids = descendants(proc.pid)
    reap.extend(kids)
    assert job_processes(kids) == {"daemon": 1, "torchrun": 2, "ranks": 4}, [_cmdline(k) for k in kids]
    return kids


def wait_for_steps_now(db: Path) -> bool:
    s = summary(db)
    return bool(s and len(s["ranks"]) == 4 and all(r["steps"] >= 1 for r in s["ranks"]))


class Pty:
    """A terminal for the demo (so it opens the TUI), drained on a thread so
    the TUI never blocks writing to it."""

    def __init__(self, rows: int = 40, cols: int = 140) -> None:
        self.master, self.slave = pty.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        self.output = bytearray()
        self._thread = threading.Thread(target=self._drain, daemon=True)

    def start(self) -> None:
        os.close(self.slave)  # the child holds its own copies
        self._thread.start()

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:  # EIO: every copy of the slave side is closed
                return
            if not data:
                return
            self.output += data

    def text(self) -> str:
        return self.output.decode(errors="replace")

    def close(self) -> None:
        self._thread.join(10)
        os.close(self.master)


# ------------------------------------------------------------------ tests


def test_demo_summarises_4_ranks_on_2_nodes_with_rank_3_slow(tmp_path: Path) -> None:
    db = tmp_path / "demo.db"
    steps = 30
    proc = subprocess.Popen(demo_command(db, steps), env=demo_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-4000:]
    assert leftovers(proc.pid, tmp_path) == []

    # stdout is not a terminal: the demo printed the summary text.
    assert "topology: 2 node(s) x world size 4, ddp" in out, out
    s = summary(db)
    assert s is not None
    assert s["topology"] == {"nnodes": 2, "world_size": 4, "parallelism": "ddp"}
    ranks = {r["global_rank"]: r for r in s["ranks"]}
    assert {g: (r["node_rank"], r["local_rank"]) for g, r in ranks.items()} == {
        0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}
    assert all(r["steps"] == steps for r in ranks.values()), s["ranks"]
    assert [(n["node_rank"], n["ranks"]) for n in s["nodes"]] == [(0, [0, 1]), (1, [2, 3])]

    # Rank 3's collate sleeps 25 ms a batch: its dataloader phase dwarfs every
    # other rank's, and is the largest phase of its own step.
    slow = ranks[3]["phases_ms_median"]
    others = max(ranks[g]["phases_ms_median"]["dataloader"] for g in (0, 1, 2))
    assert slow["dataloader"] > 5 * others, s["ranks"]
    measured = {phase: ms for phase, ms in slow.items() if ms is not None}
    assert max(measured, key=lambda phase: measured[phase]) == "dataloader", slow
    assert any(v["scope"].get("global_rank") == 3 for v in s["verdicts"]), s["verdicts"]
    assert s["delivery"]["rows_dropped_reported"] == 0


def test_sigterm_mid_run_stops_every_child(tmp_path: Path, reap: list[psutil.Process]) -> None:
    db = tmp_path / "demo.db"
    with open(tmp_path / "demo.out", "wb") as log:
        proc = subprocess.Popen(demo_command(db, LONG_RUN), env=demo_env(tmp_path), stdout=log,
                                stderr=subprocess.STDOUT)
    kids = running_demo(proc, db, reap)

    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=120)
    output = (tmp_path / "demo.out").read_text(errors="replace")
    assert code == 128 + signal.SIGTERM, output
    assert "Traceback" not in output, output
    # Checked right away: the demo returns only once its children are gone.
    assert [_cmdline(k) for k in kids if _alive(k)] == []
    assert leftovers(proc.pid, tmp_path) == []


def test_sighup_stops_the_tui_and_every_child(tmp_path: Path, reap: list[psutil.Process]) -> None:
    """A terminal (the demo opens the TUI) that hangs up, as a closed SSH session does."""
    db = tmp_path / "demo.db"
    term = Pty()
    proc = subprocess.Popen(demo_command(db, LONG_RUN), env=demo_env(tmp_path, TERM="xterm-256color"),
                            stdin=term.slave, stdout=term.slave, stderr=term.slave)
    term.start()
    try:
        kids = running_demo(proc, db, reap)
        proc.send_signal(signal.SIGHUP)
        code = proc.wait(timeout=120)
    finally:
        term.close()
    assert code == 128 + signal.SIGHUP, term.text()[-4000:]
    assert "Traceback" not in term.text(), term.text()[-4000:]
    assert [_cmdline(k) for k in kids if _alive(k)] == []
    assert leftovers(proc.pid, tmp_path) == []


def test_tui_mode_exits_with_the_failed_jobs_status(tmp_path: Path, reap: list[psutil.Process]) -> None:
    """A negative collate sleep makes rank 3 raise on its first batch, so the job
    fails while the TUI is open; quitting the TUI then must not report success."""
    db = tmp_path / "demo.db"
    term = Pty()
    proc = subprocess.Popen(demo_command(db, 30, "--slow-ms", "-5"),
                            env=demo_env(tmp_path, TERM="xterm-256color"),
                            stdin=term.slave, stdout=term.slave, stderr=term.slave)
    term.start()
    reap.append(psutil.Process(proc.pid))
    agents: dict[int, psutil.Process] = {}  # torchrun nodes, recorded while they run
    try:
        def job_over() -> bool:
            assert proc.poll() is None, f"the demo exited with the TUI open: {proc.returncode}"
            for kid in psutil.Process(proc.pid).children():
                if kid.pid not in agents and "torch.distributed.run" in _cmdline(kid):
                    agents[kid.pid] = kid
                    reap.append(kid)
            return len(agents) == 2 and not any(_alive(a) for a in agents.values())

        wait_for(job_over, timeout=300, interval=0.5, what="both torchrun nodes to exit")
        os.write(term.master, b"q")  # the TUI's quit key
        code = proc.wait(timeout=120)
    finally:
        term.close()
    assert code not in (0, None), term.text()[-4000:]
    assert "the training job failed" in term.text(), term.text()[-4000:]
    assert leftovers(proc.pid, tmp_path) == []
