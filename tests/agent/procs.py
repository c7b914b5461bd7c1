"""Run a short training script in a fresh interpreter with a clean agent env."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable

_LAUNCHER_PREFIXES = ("TRACEML_", "SLURM_", "TORCHELASTIC_")
_LAUNCHER_NAMES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                   "MASTER_ADDR", "MASTER_PORT", "GROUP_WORLD_SIZE"}


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_LAUNCHER_PREFIXES) and k not in _LAUNCHER_NAMES}
    env["PYTHONPATH"] = str(ROOT)
    env["TRACEML_FLUSH_S"] = "0.1"
    env["TRACEML_NO_RELAY"] = "1"  # tests point the agent at their own relay stand-in
    env["OMP_NUM_THREADS"] = "1"  # a shared 2-core box
    env.update(extra)
    return env


def spawn(code: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [PYTHON, "-c", textwrap.dedent(code)],
        cwd=str(ROOT),
        env=clean_env(**env),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run(code: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-c", textwrap.dedent(code)],
        cwd=str(ROOT),
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def traceml_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("[traceml]")]
