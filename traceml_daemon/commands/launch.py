"""``traceml-daemon launch``: a daemon and a torchrun job, one command per node.

    traceml-daemon launch --nproc-per-node 4 -- train.py --epochs 3

On one node (no ``--nnodes``, or ``--nnodes 1``) it starts ``traceml-daemon
serve`` as a child on a free loopback port, runs the script under torchrun
(``--standalone``) with ``TRACEML_DAEMON``/``TRACEML_RELAY_PORT`` pointing at
it, shows the TUI on a terminal or prints the final summary at the end
otherwise, and exits with the script's exit code.

Across nodes, the same command runs on every node with its own ``--node-rank``:

    traceml-daemon launch --nnodes 2 --node-rank K --master-addr head --token-file ~/.traceml-token \\
        --nproc-per-node 8 -- train.py

Node 0 starts the daemon bound for the network (0.0.0.0, with the token)
unless ``--daemon HOST:PORT`` names one; every node runs torchrun with the
static rendezvous at ``--master-addr:--master-port`` and its ranks send to
node 0's daemon. Node 0 stops its daemon once its own job ended and every
other node's ranks reported their end (or nothing came from them for
``--wait-nodes`` seconds), then prints the summary.

Every child runs in its own process group and is stopped on any way out (end,
Ctrl-C, SIGTERM). This module never imports torch: torchrun runs in a child.
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
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType

from traceml_daemon.commands.cli import DEFAULT_PORT
from traceml_wire.addresses import is_loopback

DEFAULT_DB = "traceml.db"
DEFAULT_MASTER_PORT = 29500  # torchrun's own default
DEFAULT_WAIT_NODES_S = 60.0
_LISTENING = re.compile(r"listening on \S+:(\d+)")
_TOKEN_HOWTO = (
    "create one with `openssl rand -hex 32 > ~/.traceml-token`, copy that file to every node and pass "
    "--token-file ~/.traceml-token on each (or export TRACEML_TOKEN with the same value everywhere)"
)

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


def _count(minimum: int, what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}: {what}")
        return value

    return parse


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"{value} is not a port number (0 to 65535)")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text} must be 0 or more")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nnodes", type=_count(1, "a job runs on at least one node"), default=1,
                        help="nodes in the job, the same on every node (default 1: a single-node run)")
    parser.add_argument("--node-rank", type=_count(0, "node ranks start at 0"), default=0,
                        help="this node's rank, 0 to nnodes-1; node 0 runs the daemon (default 0)")
    parser.add_argument("--master-addr", help="node 0's address as every node reaches it (multi-node runs)")
    parser.add_argument("--master-port", type=_port,
                        help=f"torchrun's rendezvous port on node 0 (default {DEFAULT_MASTER_PORT})")
    parser.add_argument("--nproc-per-node", type=_count(1, "a node runs at least one rank"), default=1,
                        help="ranks to start on this node (default 1)")
    parser.add_argument("--daemon", metavar="HOST:PORT",
                        help="send to this running daemon instead of starting one on node 0")
    parser.add_argument("--token-file", help="file holding the shared token (else $TRACEML_TOKEN); "
                                             "required on every node of a multi-node run")
    parser.add_argument("--relay-port", type=_port, help="this node's relay port on loopback (default: any free)")
    parser.add_argument("--db", default=DEFAULT_DB, help=f"SQLite database on node 0 (default ./{DEFAULT_DB})")
    parser.add_argument("--port", type=_port,
                        help="the daemon's port: node 0's daemon listens on it, the other nodes send to it "
                             f"(default: any free on one node, {DEFAULT_PORT} across nodes)")
    parser.add_argument("--wait-nodes", type=_seconds, default=DEFAULT_WAIT_NODES_S, metavar="SECONDS",
                        help="node 0, after its own job ended: give up waiting for the other nodes' final "
                             f"batches once nothing came from them for this long (default {DEFAULT_WAIT_NODES_S:g})")
    parser.add_argument("--no-tui", action="store_true", help="print the final summary even on a terminal")
    # Not "command": the top-level parser keeps the subcommand name under that dest.
    parser.add_argument("script", nargs=argparse.REMAINDER, metavar="-- SCRIPT", help="the training script and its arguments")


@dataclass(frozen=True)
class Plan:
    """What this node does, decided from the flags before anything starts."""

    script: list[str]
    nnodes: int
    node_rank: int
    rendezvous: list[str]  # torchrun's flags before the script
    start_daemon: bool
    bind_host: str  # where the daemon started here listens
    port: int  # that daemon's port (0: any free), or the remote daemon's
    upstream: str  # TRACEML_DAEMON; empty when the daemon starts here, known once it listens
    token: str | None
    token_file: str | None
    relay_port: int | None

    @property
    def multi(self) -> bool:
        return self.nnodes > 1


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _parse_daemon(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LaunchError(f"--daemon {text!r} is not HOST:PORT; name the running daemon, e.g. --daemon head-node:29765")
    return host, int(port)


def _read_token(token_file: str | None, env: dict[str, str]) -> str | None:
    if not token_file:
        return env.get("TRACEML_TOKEN") or None
    try:
        token = Path(token_file).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise LaunchError(f"cannot read --token-file {token_file} ({exc.strerror}); {_TOKEN_HOWTO}") from None
    if not token:
        raise LaunchError(f"--token-file {token_file} is empty; {_TOKEN_HOWTO}")
    return token


def _check_nodes(args: argparse.Namespace) -> None:
    if args.node_rank >= args.nnodes:
        if args.nnodes == 1:
            raise LaunchError(f"--node-rank {args.node_rank} needs --nnodes: a multi-node run gives every node "
                              "the same --nnodes N (the number of nodes) and its own --node-rank 0 to N-1")
        raise LaunchError(f"--node-rank {args.node_rank} is not below --nnodes {args.nnodes}: node ranks run from 0 "
                          f"to {args.nnodes - 1}; give every node the same --nnodes and its own --node-rank")
    if args.nnodes == 1 and (args.master_addr or args.master_port is not None):
        raise LaunchError("--master-addr and --master-port are the rendezvous of a multi-node run: add --nnodes N "
                          "and --node-rank K on every node, or drop them for a single-node run (torchrun --standalone)")
    if args.nnodes > 1 and not args.master_addr:
        who = f"--node-rank {args.node_rank}" if args.node_rank else f"a {args.nnodes}-node run"
        raise LaunchError(f"{who} needs --master-addr HOST: node 0's address as every node reaches it, the same "
                          "on every node (torchrun's rendezvous and the daemon are there)")


def make_plan(args: argparse.Namespace, env: dict[str, str]) -> Plan:
    """Check the flags and decide this node's part; raises LaunchError naming the fix."""
    _check_nodes(args)
    remote: tuple[str, int] | None = None
    if args.daemon:
        if args.port is not None:
            raise LaunchError("--port is the port of the daemon launch starts; with --daemon give HOST:PORT "
                              "of the running one and drop --port")
        remote = _parse_daemon(args.daemon)
    token = _read_token(args.token_file, env)
    if token is None and args.nnodes > 1:
        raise LaunchError(f"a multi-node run needs a shared token (node 0's daemon listens on the network and "
                          f"refuses to do so without one): {_TOKEN_HOWTO}")
    if token is None and remote is not None and not is_loopback(remote[0]):
        raise LaunchError(f"--daemon {args.daemon} is not a loopback address, and a daemon listening on the network "
                          f"requires a token: {_TOKEN_HOWTO}")
    multi = args.nnodes > 1
    start_daemon = remote is None and args.node_rank == 0
    if remote:
        port = remote[1]
    elif args.port is not None:
        port = args.port
    else:
        # Across nodes the others must know the port without asking; alone, any free one will do.
        port = DEFAULT_PORT if multi else 0
    if start_daemon:
        db = Path(args.db)
        if not db.parent.exists():
            raise LaunchError(f"directory of --db {args.db} does not exist; create it or choose another --db")
        if multi and port == 0:
            raise LaunchError("--port 0 across nodes: the other nodes could not know the port; pass a fixed --port "
                              "(the same on every node) or leave it out")
        upstream = ""
    elif remote:
        upstream = _host_port(*remote)
    else:
        upstream = _host_port(args.master_addr, port)
    if multi:
        master_port = DEFAULT_MASTER_PORT if args.master_port is None else args.master_port
        if master_port == 0:
            raise LaunchError(f"--master-port 0: the other nodes could not know the port; pass a fixed one, the same "
                              f"on every node, or leave it out (default {DEFAULT_MASTER_PORT})")
        rendezvous = ["--nnodes", str(args.nnodes), "--node-rank", str(args.node_rank),
                      "--master-addr", args.master_addr, "--master-port", str(master_port)]
    else:
        rendezvous = ["--standalone"]
    return Plan(
        script=_script_argv(list(args.script)),
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rendezvous=[*rendezvous, "--nproc-per-node", str(args.nproc_per_node)],
        start_daemon=start_daemon,
        # Across nodes the daemon must be reachable from the others; the token guards it.
        bind_host="0.0.0.0" if multi else "127.0.0.1",
        port=port,
        upstream=upstream,
        token=token,
        token_file=args.token_file,
        relay_port=args.relay_port,
    )


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


def _start_daemon(plan: Plan, db: str, log_path: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], int]:
    cmd = [sys.executable, "-m", "traceml_daemon", "serve", "--host", plan.bind_host, "--port", str(plan.port),
           "--db", db]
    if plan.token_file:
        cmd += ["--token-file", plan.token_file]  # the file, so the token never shows in a process list
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


def pending_nodes(db: str, since: float, nnodes: int) -> tuple[list[int], float]:
    """Nodes 1..nnodes-1 whose ranks have not all reported their end, and the
    newest time any of their data was stored (0.0 when none was)."""
    from traceml_daemon.store.read.runs import other_nodes_ranks

    ranks: dict[int, list[tuple[int, int | None, bool]]] = {}
    newest = 0.0
    rows = other_nodes_ranks(db, since)
    for node, attempt, local_world, last_seen, finished in rows:
        ranks.setdefault(int(node), []).append((int(attempt or 0), local_world, bool(finished)))
        newest = max(newest, float(last_seen or 0.0))
    pending: list[int] = []
    for node in range(1, nnodes):
        seen = ranks.get(node, [])
        # A restarted worker group is a new attempt: only the newest one can still report.
        latest = max((a for a, _, _ in seen), default=0)
        current = [(lw, done) for a, lw, done in seen if a == latest]
        expected = max((lw for lw, _ in current if lw), default=1)
        if len(current) < expected or not all(done for _, done in current):
            pending.append(node)
    return pending, newest


def _wait_for_nodes(db: str, since: float, nnodes: int, idle_s: float) -> None:
    """Keep the daemon up until the other nodes' final batches are stored, or
    nothing came from them for ``idle_s``: their relays may still be delivering."""
    pending, newest = pending_nodes(db, since, nnodes)
    if not pending:
        return
    print(f"traceml: this node's job ended; waiting for node(s) {_names(pending)} to deliver their final batches "
          f"(giving up after {idle_s:g} s without news from them)", file=sys.stderr, flush=True)
    quiet_since = time.monotonic()
    while pending:
        if time.monotonic() - quiet_since >= idle_s:
            print(f"traceml: stopped waiting: node(s) {_names(pending)} did not report the end of all their ranks; "
                  "the summary shows what arrived", file=sys.stderr, flush=True)
            return
        time.sleep(0.2)
        pending, latest = pending_nodes(db, since, nnodes)
        if latest > newest:
            newest, quiet_since = latest, time.monotonic()


def _names(nodes: list[int]) -> str:
    return ", ".join(str(n) for n in nodes)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Terminated


def _banner(plan: Plan, args: argparse.Namespace, upstream: str) -> str:
    if not plan.multi:
        if plan.start_daemon:
            return f"traceml: daemon on {upstream}, database {args.db}"
        return f"traceml: sending to the daemon at {upstream}"
    where = f"traceml: node {plan.node_rank} of {plan.nnodes}"
    if plan.start_daemon:
        return (f"{where}: daemon on {plan.bind_host}:{plan.port} (the other nodes send to "
                f"{_host_port(args.master_addr, plan.port)}), database {args.db}")
    return f"{where}: sending to the daemon at {upstream}"


def _run(plan: Plan, args: argparse.Namespace) -> int:
    use_tui = plan.start_daemon and sys.stdout.isatty() and not args.no_tui
    logs = Path(args.db).parent.resolve()
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default too; said here so it is not warned about
    job: subprocess.Popen[bytes] | None = None
    daemon: subprocess.Popen[bytes] | None = None
    since = time.time()  # the daemon stamps ranks with this machine's clock
    if plan.start_daemon:
        daemon, port = _start_daemon(plan, args.db, logs / "traceml-daemon.log", env)
        plan = replace(plan, port=port)
        upstream = f"127.0.0.1:{port}"  # this node's own ranks: a bind on every address includes loopback
    else:
        upstream = plan.upstream
    code = 1
    try:
        env.update(TRACEML_DAEMON=upstream, TRACEML_RELAY_PORT=str(plan.relay_port or _free_port()))
        # torch.profiler traces (TRACEML_PROFILE_STEPS) land beside the database, unless told otherwise.
        env.setdefault("TRACEML_PROFILE_DIR", str(logs / "traceml_profiles"))
        if plan.token:
            env["TRACEML_TOKEN"] = plan.token
        cmd = [sys.executable, "-c", _TORCHRUN, *plan.rendezvous, *plan.script]
        print(_banner(plan, args, upstream), file=sys.stderr, flush=True)
        if use_tui:
            # The TUI owns the terminal: the job's output goes to a file beside the db.
            job_log = logs / "traceml-job.log"
            with open(job_log, "wb") as out:
                job = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            from traceml_daemon.tui.app import run_tui

            run_tui(args.db)
            if job.poll() is None:
                print("traceml: the TUI was closed; stopping the training job", file=sys.stderr)
            code = _stop(job, signal.SIGINT, 30.0) if job.poll() is None else _exit_code(job.returncode)
            print(f"traceml: job log in {job_log}", file=sys.stderr)
        else:
            job = subprocess.Popen(cmd, env=env, start_new_session=True)
            code = _exit_code(job.wait())
        if daemon is not None and plan.multi:
            _wait_for_nodes(args.db, since, plan.nnodes, args.wait_nodes)
    except (KeyboardInterrupt, _Terminated) as exc:
        code = 130 if isinstance(exc, KeyboardInterrupt) else 143
        if job is not None:
            # SIGINT first: torchrun forwards it to the ranks, which can flush their telemetry.
            _stop(job, signal.SIGINT, 15.0)
    finally:
        if job is not None:
            _stop(job, signal.SIGTERM, 10.0)
        if daemon is not None:
            # SIGTERM makes the daemon drain, commit and write final_summary.* next to the db.
            _stop(daemon, signal.SIGTERM, 30.0)
    if daemon is not None and not use_tui:
        _print_summary(args.db)
    elif daemon is None:
        print(f"traceml: telemetry went to the daemon at {upstream}; its node holds the database and the summary",
              file=sys.stderr)
    return code


def main(args: argparse.Namespace) -> int:
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return _run(make_plan(args, dict(os.environ)), args)
    except LaunchError as exc:
        print(f"traceml-daemon launch: error: {exc}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
