"""``traceml-daemon launch``: a daemon and a single-node torchrun job, one command.

    traceml-daemon launch --nproc-per-node 4 -- train.py --epochs 3

Starts ``traceml-daemon serve`` as a child on a free port, runs the script
under torchrun (``--standalone``) with ``TRACEML_DAEMON``/``TRACEML_RELAY_PORT``
pointing at it, shows the TUI on a terminal or prints the final summary at
the end otherwise, and exits with the script's exit code. Every child runs in
its own process group and is stopped on any way out (end, Ctrl-C, SIGTERM).
This module never imports torch: torchrun runs in a child process.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

DEFAULT_DB = "traceml.db"
_LISTENING = re.compile(r"listening on \S+:(\d+)")

# torchrun exits 1 whatever the script's exit status was; this runs torchrun's
# own entry point in the child and exits with the first failed rank's code
# instead (a negative code is a signal, reported the shell's way as 128 + n).
_TORCHRUN = """\
import sys
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main
try:
    main()
except ChildFailedError as exc:
    print(exc, file=sys.stderr)
    code = exc.get_first_failure()[1].exitcode
    sys.exit(128 - code if code < 0 else (code or 1))
"""


class LaunchError(Exception):
    """A mistake the user can fix: printed without a traceback, exit 2."""


class _Terminated(Exception):
    """SIGTERM reached the launcher: clean up like Ctrl-C."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc-per-node", type=int, default=1, help="ranks to start on this node (default 1)")
    parser.add_argument("--db", default=DEFAULT_DB, help=f"SQLite database (default ./{DEFAULT_DB})")
    parser.add_argument("--port", type=int, default=0, help="daemon port (default: any free port)")
    parser.add_argument("--no-tui", action="store_true", help="print the final summary even on a terminal")
    # Not "command": the top-level parser keeps the subcommand name under that dest.
    parser.add_argument("script", nargs=argparse.REMAINDER, metavar="-- SCRIPT", help="the training script and its arguments")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _script_argv(command: list[str]) -> list[str]:
    if not command or command[0] != "--":
        raise LaunchError("put the training script after `--`, e.g. traceml-daemon launch -- train.py --steps 100")
    argv = command[1:]
    if not argv:
        raise LaunchError("no training script after `--`")
    if not Path(argv[0]).is_file():
        raise LaunchError(f"training script {argv[0]} not found")
    return argv


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


def _stop(proc: subprocess.Popen[bytes], first: int, grace_s: float) -> int:
    """Signal ``proc``'s whole group with ``first``, escalating to SIGKILL after ``grace_s``."""
    if proc.poll() is None:
        _signal_group(proc, first)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
    # The group may outlive its leader (workers of a dead torchrun): never leave them behind.
    _signal_group(proc, signal.SIGKILL)
    return _exit_code(proc.returncode)


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


def _start_daemon(args: argparse.Namespace, log_path: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], int]:
    cmd = [sys.executable, "-m", "traceml_daemon", "serve", "--port", str(args.port), "--db", args.db]
    with open(log_path, "wb") as log:  # truncated: the port is read from this run's line only
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        match = _LISTENING.search(log_path.read_text(errors="replace"))
        if match:
            return proc, int(match.group(1))
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    _stop(proc, signal.SIGTERM, 5.0)
    raise LaunchError(f"the daemon did not start; its log ({log_path}):\n{log_path.read_text(errors='replace')}")


def _print_summary(db: str) -> None:
    from traceml_daemon.commands.summary import build_summary, render_text
    from traceml_daemon.store.reader import StoreError

    try:
        sys.stdout.write(render_text(build_summary(db)))
        sys.stdout.flush()
    except StoreError as exc:
        print(f"traceml-daemon launch: no summary: {exc}", file=sys.stderr)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Terminated


def _run(args: argparse.Namespace, script: list[str]) -> int:
    use_tui = sys.stdout.isatty() and not args.no_tui
    db = Path(args.db)
    if db.parent and not db.parent.exists():
        raise LaunchError(f"directory of --db {args.db} does not exist")
    logs = db.parent.resolve()
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default too; said here so it is not warned about
    job: subprocess.Popen[bytes] | None = None
    daemon, port = _start_daemon(args, logs / "traceml-daemon.log", env)
    code = 1
    try:
        env.update(TRACEML_DAEMON=f"127.0.0.1:{port}", TRACEML_RELAY_PORT=str(_free_port()))
        cmd = [sys.executable, "-c", _TORCHRUN, "--standalone", "--nproc-per-node", str(args.nproc_per_node), *script]
        print(f"traceml: daemon on 127.0.0.1:{port}, database {args.db}", file=sys.stderr, flush=True)
        if use_tui:
            # The TUI owns the terminal: the job's output goes to a file beside the db.
            job_log = logs / "traceml-job.log"
            with open(job_log, "wb") as out:
                job = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            from traceml_daemon.tui.app import run_tui

            run_tui(str(db))
            if job.poll() is None:
                print("traceml: the TUI was closed; stopping the training job", file=sys.stderr)
            code = _stop(job, signal.SIGINT, 30.0) if job.poll() is None else _exit_code(job.returncode)
            print(f"traceml: job log in {job_log}", file=sys.stderr)
        else:
            job = subprocess.Popen(cmd, env=env, start_new_session=True)
            code = _exit_code(job.wait())
    except (KeyboardInterrupt, _Terminated) as exc:
        code = 130 if isinstance(exc, KeyboardInterrupt) else 143
        if job is not None:
            # SIGINT first: torchrun forwards it to the ranks, which can flush their telemetry.
            _stop(job, signal.SIGINT, 15.0)
    finally:
        if job is not None:
            _stop(job, signal.SIGTERM, 10.0)
        # SIGTERM makes the daemon drain, commit and write final_summary.* next to the db.
        _stop(daemon, signal.SIGTERM, 30.0)
    if not use_tui:
        _print_summary(str(db))
    return code


def main(args: argparse.Namespace) -> int:
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return _run(args, _script_argv(list(args.script)))
    except LaunchError as exc:
        print(f"traceml-daemon launch: error: {exc}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
