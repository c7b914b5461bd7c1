"""A head node's install: the package with its base dependencies and no torch.

A fresh virtual environment gets the project from a copy of its source (so
nothing of this checkout is on its path) with ``pip install`` and only the
base dependencies, reusing pip's cache. There, torch must not be importable,
and the daemon must serve (a relay's handshake and rbatches through the raw
wire), summarise the database it wrote and show the TUI's help, while
``import agent; agent.init()`` says in one line what to install and does
nothing else. The same workload is run by a daemon of the main environment,
so the two peak RSS figures (VmHWM) compare like with like.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.procs import REPO, DaemonProcess, base_env
from tests.traceml_daemon.wire_client import RELAY, WireClient, agent_sender, peers_for, steps_body
from traceml_wire import messages

pytestmark = pytest.mark.slow

PACKAGES = ("agent", "relay", "traceml_daemon", "traceml_wire")
RANKS = (0, 1)
RBATCHES = 40
STEPS_PER_BODY = 250
INSTALL_TIMEOUT_S = 600


def _venv_env() -> dict[str, str]:
    """The test environment without the checkout on PYTHONPATH: only the installed copy may answer."""
    env = base_env()
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


class TorchFree:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.bin = root / "venv" / "bin"
        self.python = self.bin / "python"
        self.env = _venv_env()

    def run(self, *argv: str | Path, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        # cwd outside the checkout: ``python -c`` puts the working directory on sys.path.
        return subprocess.run([str(a) for a in argv], cwd=self.root, env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def python_c(self, code: str) -> subprocess.CompletedProcess[str]:
        return self.run(self.python, "-c", code)


@pytest.fixture(scope="module")
def torch_free(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TorchFree]:
    root = tmp_path_factory.mktemp("head_node")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for package in PACKAGES:
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    venv = TorchFree(root)
    made = subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], capture_output=True, text=True,
                          timeout=120)
    assert made.returncode == 0, made.stderr
    done = venv.run(venv.python, "-m", "pip", "install", "--no-input", "--progress-bar", "off", src,
                    timeout=INSTALL_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    yield venv


def _feed(port: int) -> None:
    """A relay's handshake, then RBATCHES rbatches of two ranks' steps, each acknowledged."""
    with WireClient(port) as client:
        reply = client.handshake(RELAY)
        assert reply is not None and reply["t"] == messages.ACCEPT, reply
        for seq in range(1, RBATCHES + 1):
            first = (seq - 1) * STEPS_PER_BODY
            items = [[agent_sender("s1", r), seq, steps_body(first, STEPS_PER_BODY)] for r in RANKS]
            client.rbatch(seq, items, peers_for(*RANKS))
        acked = 0
        while acked < RBATCHES:  # acknowledgements are cumulative and may come coalesced
            message = client.recv()
            assert message is not None and message["t"] == messages.ACK, message
            acked = message["seq"]


def _status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{key} missing from /proc/{pid}/status")


def _maps_torch(pid: int) -> bool:
    """A file of the torch package (its shared libraries) is mapped into the process."""
    return "/site-packages/torch/" in Path(f"/proc/{pid}/maps").read_text()


class VenvDaemon(DaemonProcess):
    """``traceml-daemon serve`` from the torch-free environment's own console script."""

    def __init__(self, venv: TorchFree, db: Path) -> None:
        super().__init__(db, env=venv.env)
        self.venv = venv

    def command(self) -> list[str]:
        return [str(self.venv.bin / "traceml-daemon"), "serve", "--host", self.host, "--port", str(self.port),
                "--db", str(self.db)]


def _serve_workload(daemon: DaemonProcess) -> int:
    """Run the workload through ``daemon``; its peak RSS in KiB (VmHWM), read before it stops."""
    with daemon:
        assert daemon.proc is not None
        _feed(daemon.port)
        peak_kb = _status_kb(daemon.proc.pid, "VmHWM")
        assert not _maps_torch(daemon.proc.pid), "the daemon mapped a torch library"
        rc = daemon.stop()
    assert rc == 0, daemon.log()
    return peak_kb


def test_torch_is_not_importable_and_the_package_is_the_installed_copy(torch_free: TorchFree) -> None:
    done = torch_free.python_c(
        "import importlib.util, sys\n"
        "import traceml_daemon, agent, relay, traceml_wire\n"
        "print(importlib.util.find_spec('torch') is None)\n"
        "print(*(m.__file__ for m in (traceml_daemon, agent, relay, traceml_wire)), sep='\\n')\n"
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split()
    assert lines[0] == "True", "torch is importable in the torch-free environment"
    venv = torch_free.root / "venv"
    assert all(Path(f).is_relative_to(venv) for f in lines[1:]), lines
    # Nor does pip know of it: the base dependencies never asked for it.
    shown = torch_free.run(torch_free.python, "-m", "pip", "show", "torch")
    assert shown.returncode != 0, shown.stdout


def test_daemon_serves_summarises_and_shows_the_tui_help(torch_free: TorchFree, tmp_path: Path) -> None:
    db = tmp_path / "torch_free.db"
    peak_kb = _serve_workload(VenvDaemon(torch_free, db))

    done = torch_free.run(torch_free.bin / "traceml-daemon", "summary", "--db", db, "--json")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert sorted(r["global_rank"] for r in summary["ranks"]) == list(RANKS), summary["ranks"]
    assert all(r["steps"] == RBATCHES * STEPS_PER_BODY for r in summary["ranks"]), summary["ranks"]

    done = torch_free.run(torch_free.bin / "traceml-daemon", "tui", "--help")
    assert done.returncode == 0 and "--db" in done.stdout, done.stdout + done.stderr
    done = torch_free.run(torch_free.bin / "traceml-relay", "--help")
    assert done.returncode == 0, done.stdout + done.stderr

    # The same workload served by the main environment's daemon (torch installed, never imported).
    baseline_kb = _serve_workload(DaemonProcess(tmp_path / "main_venv.db"))
    line = (f"daemon VmHWM, {RBATCHES} rbatches x {len(RANKS)} ranks x {STEPS_PER_BODY} steps: "
            f"torch-free install {peak_kb / 1024:.1f} MiB, main environment {baseline_kb / 1024:.1f} MiB")
    print(line)  # the figures, for a run with -s or -rP


def test_agent_without_torch_says_one_line_and_does_nothing(torch_free: TorchFree) -> None:
    done = torch_free.python_c("import agent\nprint('imported')\n")
    assert done.returncode == 0 and done.stdout.strip() == "imported" and done.stderr == "", done.stderr

    env = dict(torch_free.env, TRACEML_DAEMON="127.0.0.1:9")
    done = subprocess.run(
        [str(torch_free.python), "-c",
         "import agent\n"
         "agent.init()\n"
         "with agent.trace_step(None):\n    pass\n"
         "with agent.span('eval'):\n    pass\n"
         "agent.log(loss=1.0)\nagent.instant('mark')\nagent.init()\nagent.shutdown()\n"
         "import sys\n"
         "print(sorted(m for m in ('torch', 'agent.tracer', 'agent.batch') if m in sys.modules))\n"
         "import threading\nprint(threading.active_count())\n"],
        cwd=torch_free.root, env=env, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("[traceml] "), done.stderr
    assert "torch is not installed" in lines[0] and "pip install 'traceml-daemon[agent]'" in lines[0], lines[0]
    # No sender thread was started: nothing but the main thread, nothing of the capture machinery.
    assert done.stdout.split("\n")[:2] == ["[]", "1"], done.stdout
