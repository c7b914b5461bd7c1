"""Real processes for tests: the daemon binary, torchrun jobs, the summary CLI.

Nothing here fakes a component: the daemon is ``python -m traceml_daemon
serve`` on a real port with a real SQLite file, jobs are real ``torchrun``
invocations with the gloo backend.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
T = TypeVar("T")


_HANDED_OUT: set[int] = set()


def _ephemeral_range() -> range:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


_EPHEMERAL = _ephemeral_range()
_LISTEN_PORTS = range(20000, 32768)  # below the usual ephemeral range (checked against the real one)
_DEFAULT_PORTS = frozenset({29500, 29765, 29766})  # torchrun's, the daemon's and the relay's defaults


def free_port() -> int:
    """A port free now, outside the kernel's ephemeral range and not handed out before in
    this test process. Outside the range: between this call and the listener's bind, an
    outgoing connection (a fuzz attacker's, a relay's) can be given an ephemeral port as its
    source, and a port taken from that range then collides (torchrun's master port did:
    EADDRINUSE). Not twice: a test asking for two (a daemon's and its metrics endpoint's)
    must get two."""
    rng = random.Random()
    for _ in range(2000):
        port = rng.choice(_LISTEN_PORTS)
        if port in _HANDED_OUT or port in _EPHEMERAL or port in _DEFAULT_PORTS:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free listening port below the ephemeral range")


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRACEML_", "TORCHELASTIC_", "SLURM_"))}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def wait_for(predicate: Callable[[], T], timeout: float, interval: float = 0.2, what: str = "condition") -> T:
    """Poll until predicate returns a truthy value (a liveness bound, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    last: T = predicate()
    while not last:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
        last = predicate()
    return last


class DaemonProcess:
    """``traceml-daemon serve`` as a child process, with its log captured."""

    def __init__(self, db: Path, port: int | None = None, host: str = "127.0.0.1",
                 args: Iterable[str] = (), env: dict[str, str] | None = None,
                 netns: str | None = None) -> None:
        self.db = Path(db)
        self.port = port or free_port()
        self.host = host
        self.args = list(args)
        self.env = env or base_env()
        self.netns = netns
        self.proc: subprocess.Popen[str] | None = None
        self.lines: list[str] = []
        self._ready = threading.Event()

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "traceml_daemon", "serve", "--host", self.host,
               "--port", str(self.port), "--db", str(self.db), *self.args]
        return ["ip", "netns", "exec", self.netns, *cmd] if self.netns else cmd

    def start(self, timeout: float = 60.0) -> DaemonProcess:
        self._ready.clear()
        self.proc = subprocess.Popen(self.command(), env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._pump, args=(self.proc,), daemon=True).start()
        if not self._ready.wait(timeout):
            self.stop()
            raise AssertionError("daemon did not start:\n" + self.log())
        return self

    def _pump(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append(line)
            if "listening on" in line:
                self._ready.set()

    def log(self) -> str:
        return "".join(self.lines)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill9(self) -> None:
        self.stop(signal.SIGKILL)

    def __enter__(self) -> DaemonProcess:
        # Also used as `with DaemonProcess(...).start() as d:`: never start a second one.
        return self if self.proc is not None and self.proc.poll() is None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def torchrun(script: str | Path, script_args: Iterable[str] = (), *, nproc: int = 2, nnodes: int = 1,
             node_rank: int = 0, master_addr: str = "127.0.0.1", master_port: int | None = None,
             env: dict[str, str] | None = None, netns: str | None = None,
             timeout: float = 300.0, background: bool = False) -> Any:
    """Run (or start, with background=True) a real torchrun job with gloo on CPU."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
           "--nproc-per-node", str(nproc), "--node-rank", str(node_rank),
           "--master-addr", master_addr, "--master-port", str(master_port or free_port()),
           str(script), *script_args]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    env = env or base_env()
    if background:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Run ``traceml-daemon ARGS`` and return the finished process."""
    return subprocess.run([sys.executable, "-m", "traceml_daemon", *args], env=env or base_env(),
                          capture_output=True, text=True, timeout=timeout)


def summary(db: Path) -> dict[str, Any] | None:
    """``summary --json`` of a database, or None while it is not readable yet."""
    if not Path(db).exists():
        return None
    done = cli("summary", "--db", str(db), "--json")
    if done.returncode != 0:
        return None
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError:
        return None


def wait_for_steps(db: Path, ranks: int, steps: int, timeout: float = 60.0) -> dict[str, Any]:
    """Wait until ``ranks`` ranks each stored ``steps`` steps; return the summary."""

    def ready() -> dict[str, Any] | None:
        s = summary(db)
        if s and len(s.get("ranks", [])) >= ranks and all(r["steps"] >= steps for r in s["ranks"]):
            return s
        return None

    return wait_for(ready, timeout, interval=0.5, what=f"{ranks} ranks x {steps} steps in {db}")
