"""The daemon side must never pull in torch (it runs on head nodes without GPUs)."""

from __future__ import annotations

import subprocess
import sys

from tests.support.procs import base_env

MODULES = [
    "traceml_daemon",
    "traceml_daemon.commands.cli",
    "traceml_daemon.net.server",
    "traceml_daemon.net.peer",
    "traceml_daemon.ingest.decode",
    "traceml_daemon.ingest.live",
    "traceml_daemon.commands.summary",
    "traceml_daemon.commands.ingest",
    "traceml_daemon.ingest.pipeline",
    "traceml_daemon.store.reader",
    "traceml_daemon.store.migrate",
]


def test_daemon_modules_do_not_import_torch() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "from traceml_daemon.commands.cli import build_parser\n"
        "build_parser()\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad\n"
        "assert 'textual' not in sys.modules, 'the CLI must import the TUI lazily'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=base_env(), timeout=60)
    assert done.returncode == 0, done.stderr
