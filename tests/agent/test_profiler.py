"""torch.profiler on chosen steps: the reusable StepProfiler, and the public triggers
(agent.init(profile_steps=...) with trace_step, spans with enable_profiler=True)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agent.config import load_config
from agent.errors import ErrorReporter
from agent.profiler import StepProfiler, parse_steps
from tests.agent.procs import run


def test_parse_steps_and_config() -> None:
    assert parse_steps("99, 49,49") == (49, 99)
    with pytest.raises(ValueError):
        parse_steps("4,x")
    config, problems = load_config({"TRACEML_PROFILE_STEPS": "49,99"})
    assert config.profile_steps == (49, 99) and problems == []
    config, problems = load_config({}, {"profile_steps": [3, 1]})
    assert config.profile_steps == (1, 3)
    config, problems = load_config({"TRACEML_PROFILE_STEPS": "-1"})
    assert config.profile_steps == () and "TRACEML_PROFILE_STEPS" in problems[0]


def test_step_profiler_starts_at_a_boundary_and_writes_after_k_steps(tmp_path: Path) -> None:
    import torch

    rows: list[dict[str, Any]] = []
    prof = StepProfiler([2], str(tmp_path), label="job/1", rank=lambda: 3, on_written=rows.append,
                        reporter=ErrorReporter(), steps_each=2)
    for step in range(6):
        assert prof.armed == (step <= 4)
        prof.at_step(step)
        torch.ones(8).add_(1)  # some work for the profile
    assert [(r["step"], r["steps"]) for r in rows] == [(2, 2)]
    path = Path(rows[0]["path"])
    assert path == tmp_path / "job_1-rank3-step2.pt.trace.json"
    assert json.loads(path.read_text())["traceEvents"]
    assert not prof.armed


SCRIPT = """
import asyncio, os, torch, agent
from agent import profiler, runtime
steps = [int(s) for s in os.environ["PROF_STEPS"].split(",") if s]
out = os.environ["PROF_DIR"]
agent.init(profile_steps=steps, profile_dir=out, start_relay=False, relay_port={port})
m = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for i in range(6):
    with agent.trace_step(m):
        m(torch.randn(3, 4)).sum().backward()
        opt.step()
tracer = runtime.current.tracer
print("rare-after-steps", tracer._rare, "active", profiler.active is not None)
async def main():
    for s in (8, 9):
        async with agent.span("rollout", category="scheduler", enable_profiler=True, global_step=s):
            await asyncio.sleep(0)
    with agent.span("unflagged", global_step=10):
        pass
asyncio.run(main())

@agent.span("decorated", enable_profiler=True, global_step=11)
def decorated():
    return 1

decorated()
print("files", sorted(os.listdir(out)) if os.path.isdir(out) else [])
agent.shutdown()
"""


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_listed_steps_and_flagged_spans_are_profiled(tmp_path: Path) -> None:
    out = tmp_path / "profiles"
    done = run(SCRIPT.replace("{port}", str(_closed_port())), PROF_STEPS="2,9,10,11", PROF_DIR=str(out),
               TRACEML_CAPTURE_OUTPUT="0")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "rare-after-steps True active True" in lines  # listed spans still ahead: armed
    files = [line for line in lines if line.startswith("files")][0]
    assert "rank0-step2.pt.trace.json" in files and "rank0-step9.pt.trace.json" in files
    assert "step8" not in files and "step10" not in files  # 8 is not listed; 10 carries no flag
    assert "rank0-step11.pt.trace.json" in files  # a decorator keeps the flag for every call


def test_without_profile_steps_nothing_is_armed(tmp_path: Path) -> None:
    out = tmp_path / "profiles"
    done = run(SCRIPT.replace("{port}", str(_closed_port())), PROF_STEPS="", PROF_DIR=str(out),
               TRACEML_CAPTURE_OUTPUT="0")
    assert done.returncode == 0, done.stderr
    assert "rare-after-steps False active False" in done.stdout.splitlines()
    assert "files []" in done.stdout.splitlines()
