"""``traceml-daemon demo``: a local 2 nodes x 2 ranks CPU DDP job, end to end.

Starts a real daemon and two ``torchrun --nnodes 2`` invocations on loopback
(one per simulated node, each with its own relay port, so each has its own
node relay), with one deliberately slow rank. Opens the TUI when stdout is a
terminal, prints the final summary otherwise. Every process it started is
cleaned up, also on Ctrl-C. This module never imports torch: the job runs in
child processes.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRAIN_SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train.py"


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


class _Children:
    """Every process the demo starts, each in its own session so a whole
    torchrun tree can be signalled at once."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def stop_all(self, grace_s: float = 10.0) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


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

    children = _Children()
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
            from traceml_daemon.tui.app import run_tui

            run_tui(str(db))
            return 0
        codes = [job.wait() for job in jobs]
        if any(codes):
            for node in (0, 1):
                sys.stderr.write((workdir / f"node{node}.log").read_text(errors="replace")[-4000:])
            print(f"traceml-daemon demo: the training job failed (exit codes {codes})", file=sys.stderr)
            return 1
        _signal_group(daemon, signal.SIGTERM)  # drains and commits everything acknowledged
        daemon.wait(30)
        done = subprocess.run([sys.executable, "-m", "traceml_daemon", "summary", "--db", str(db)], env=env)
        return done.returncode
    except KeyboardInterrupt:
        return 130
    finally:
        children.stop_all()
