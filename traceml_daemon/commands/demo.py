"""``traceml-daemon demo``: a local 2 nodes x 2 ranks CPU DDP job, end to end.

Starts a real daemon and two ``torchrun --nnodes 2`` invocations on loopback
(one per simulated node, each with its own relay port, so each has its own
node relay), with one deliberately slow rank. Opens the TUI when stdout is a
terminal, prints the final summary otherwise; exits with the job's status.
Every process it started is cleaned up, also on Ctrl-C, SIGTERM and SIGHUP
(a closed SSH session): the children run in sessions of their own, so no
signal reaches them unless the demo forwards it. This module never imports
torch: the job runs in child processes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import psutil

TRAIN_SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train.py"
# Signals that end the demo: each runs the same cleanup as a normal exit.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=None,
                        help="steps per rank (default: 2000 with the TUI, 200 without)")
    parser.add_argument("--slow-rank", type=int, default=3, help="global rank given a slow collate function")
    parser.add_argument("--slow-ms", type=float, default=25.0, help="extra collate time of the slow rank, ms")
    parser.add_argument("--db", default=None, help="database path (default: a new temporary directory)")
    parser.add_argument("--no-tui", action="store_true", help="print the summary even on a terminal")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Terminated(BaseException):
    """Raised on the main thread by a stop signal; BaseException so no
    ``except Exception`` on the way up swallows it before the cleanup."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _StopSignals:
    """SIGINT/SIGTERM/SIGHUP handlers that unwind ``main`` into its cleanup.

    The handler raises ``_Terminated`` on the main thread, except inside
    ``critical()`` (starting a child: raised between Popen and bookkeeping, it
    would leak an untracked child), where it is raised on leaving, and while
    the TUI runs, where an exception through Textual's event loop would leave
    the terminal in raw mode: there it asks the app to exit instead. Only the
    first signal counts; the cleanup itself runs with these signals ignored.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self._critical = 0
        self._previous: dict[int, Any] = {}
        self.app: Any = None  # the running TUI, if any

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def ignore(self) -> None:
        """During the cleanup: a second Ctrl-C or SIGTERM must not cut it short."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @contextlib.contextmanager
    def critical(self) -> Iterator[None]:
        self._critical += 1
        try:
            yield
        finally:
            self._critical -= 1
        if not self._critical and self.received is not None:
            raise _Terminated(self.received)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = self.received is None
        if first:
            self.received = signum
        if self.app is not None:
            if first and self._exit_app():
                return
            # A second signal while the TUI still runs: the app did not exit, unwind anyway.
            raise _Terminated(self.received or signum)
        if first and not self._critical:
            raise _Terminated(signum)

    def _exit_app(self) -> bool:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # the app is not running (yet, or any more)
            return False
        # call_soon_threadsafe is the signal-safe way into the loop (it wakes the
        # selector); calling app.exit() right here could reenter its message queue.
        loop.call_soon_threadsafe(self.app.exit)
        return True


class _Children:
    """Every process the demo starts, each in its own session so a whole
    torchrun tree can be signalled at once."""

    def __init__(self, signals: _StopSignals) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self._signals = signals

    def start(self, cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        with self._signals.critical(), open(log, "wb") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            self.procs.append(proc)
        return proc

    def stop_all(self, grace_s: float = 10.0) -> None:
        """SIGTERM every child's process group, SIGKILL what outlives the grace.

        Waiting for a child is not enough: torchrun's workers are its children,
        in its group, and can outlive it by a moment (or for good, if it died
        first), so the groups themselves must empty."""
        for proc in reversed(self.procs):
            if proc.poll() is None or _group_members(proc.pid):
                _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        for proc in self.procs:
            while _group_members(proc.pid):
                if time.monotonic() > deadline:
                    _signal_group(proc, signal.SIGKILL)
                    break
                time.sleep(0.05)


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes in process group ``pgid``. Zombies are left
    out: an orphan's is reaped by init whenever init gets to it, and it no
    longer runs anything."""
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc.pid)
        except (OSError, psutil.Error):  # exited meanwhile
            continue
    return members


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _exit_status(code: int) -> int:
    """A child's returncode as a shell would report it (-N: killed by signal N)."""
    return 128 - code if code < 0 else code


def _job_status(jobs: list[subprocess.Popen[bytes]], workdir: Path) -> int:
    """0, or the first failed node's exit status after showing the node logs.
    A node still running (the user quit the TUI early) is not a failure."""
    codes = [job.poll() for job in jobs]
    failed = [code for code in codes if code]
    if not failed:
        return 0
    for node in range(len(jobs)):
        sys.stderr.write((workdir / f"node{node}.log").read_text(errors="replace")[-4000:])
    print(f"traceml-daemon demo: the training job failed (exit codes {codes})", file=sys.stderr)
    return _exit_status(failed[0])


def _wait_listening(log: Path, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if "listening on" in log.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise RuntimeError(f"the daemon did not start; its log:\n{log.read_text(errors='replace')}")


def main(args: argparse.Namespace) -> int:
    if not TRAIN_SCRIPT.exists():
        print(f"traceml-daemon demo: the example job {TRAIN_SCRIPT} is missing; the demo needs a source "
              "checkout installed with `pip install -e .`", file=sys.stderr)
        return 2
    use_tui = sys.stdout.isatty() and not args.no_tui
    steps = args.steps or (2000 if use_tui else 200)
    workdir = Path(tempfile.mkdtemp(prefix="traceml-demo-"))
    db = Path(args.db) if args.db else workdir / "demo.db"
    daemon_port, master_port = _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEML_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TRACEML_DAEMON=f"127.0.0.1:{daemon_port}",
               TRACEML_SESSION=f"demo-{os.getpid()}")
    repo = str(TRAIN_SCRIPT.parents[1])
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")

    signals = _StopSignals()
    signals.install()
    children = _Children(signals)
    try:
        daemon_log = workdir / "daemon.log"
        daemon = children.start([sys.executable, "-m", "traceml_daemon", "serve", "--port", str(daemon_port),
                                 "--db", str(db)], env, daemon_log)
        _wait_listening(daemon_log, daemon)
        print(f"daemon on 127.0.0.1:{daemon_port}, database {db}, logs in {workdir}", file=sys.stderr)
        jobs = []
        for node in (0, 1):
            node_env = dict(env, TRACEML_RELAY_PORT=str(_free_port()))
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                   "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(master_port),
                   str(TRAIN_SCRIPT), "--steps", str(steps), "--slow-ranks", str(args.slow_rank),
                   "--slow-ms", str(args.slow_ms)]
            jobs.append(children.start(cmd, node_env, workdir / f"node{node}.log"))
        print(f"job: 2 nodes x 2 ranks, {steps} steps, rank {args.slow_rank} slow by {args.slow_ms:g} ms "
              "per batch", file=sys.stderr)
        if use_tui:
            from traceml_daemon.tui.app import TraceApp

            signals.app = TraceApp(str(db))
            try:
                signals.app.run()
            finally:
                signals.app = None
            if signals.received is not None:
                return 128 + signals.received
            # The user may quit while the job still runs (then it is stopped, not
            # failed); a job that already failed makes the demo fail.
            return _job_status(jobs, workdir)
        for job in jobs:
            job.wait()
        status = _job_status(jobs, workdir)
        if status:
            return status
        _signal_group(daemon, signal.SIGTERM)  # drains and commits everything acknowledged
        daemon.wait(30)
        done = subprocess.run([sys.executable, "-m", "traceml_daemon", "summary", "--db", str(db)], env=env)
        return done.returncode
    except _Terminated as stop:
        return 128 + stop.signum
    except KeyboardInterrupt:  # SIGINT before the handlers were installed
        return 130
    finally:
        signals.ignore()
        try:
            children.stop_all()
        finally:
            signals.restore()
