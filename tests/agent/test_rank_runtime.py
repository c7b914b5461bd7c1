"""One Runtime in this process, with a stand-in tracer and relay starter (no sender thread started)."""

from __future__ import annotations

from typing import Any

import pytest

from agent import rank_runtime
from agent.config import load_config
from agent.errors import ErrorReporter
from agent.identity import DistState, resolve_identity
from agent.rank_runtime import NULL_CONTEXT, Guarded, Runtime


class StandInTracer:
    """Minimal stand-in for agent.tracer.Tracer (the fixed interface only)."""

    def __init__(self, recorder: Any, **kwargs: Any) -> None:
        self.recorder = recorder
        self.kwargs = kwargs
        self.steps = 0

    def install(self) -> None: ...
    def uninstall(self) -> None: ...

    def trace_step(self, model: Any = None) -> Any:
        self.steps += 1
        return NULL_CONTEXT

    def status(self) -> dict[str, Any]:
        return {"phase": "idle", "phase_since": 0.0, "step": self.steps, "steps_done": self.steps}

    def poll(self) -> None: ...

    def parallelism(self) -> str:
        return "single"


def make_runtime(env: dict[str, str], **overrides: Any) -> Runtime:
    def starter() -> Any:
        return lambda **kwargs: None

    config, problems = load_config(env, overrides)
    assert problems == []
    return Runtime(config, env=env, tracer_factory=lambda: StandInTracer, relay_starter=starter,
                   reporter_=ErrorReporter())


def test_first_hello_waits_for_the_first_step_in_a_plain_process(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"MASTER_ADDR": "h", "MASTER_PORT": "1"}
    rt = make_runtime(env)
    assert rt._hello(False) is None  # torch.distributed may still be coming up
    monkeypatch.setattr(rank_runtime, "current_identity",
                        lambda e: resolve_identity(e, DistState(rank=1, world_size=2)))
    rt.trace_step(None)
    hello = rt._hello(False)
    assert hello is not None and hello.identity["global_rank"] == 1 and "/r1/" in hello.sender
    assert hello.identity["parallelism"] == "single"


def test_torchrun_identity_is_final_at_init() -> None:
    rt = make_runtime({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "j"})
    hello = rt._hello(False)
    assert hello is not None and hello.sender.startswith("j/a0/n0/r1/")


def test_guarded_swallows_tracer_errors_but_not_user_errors() -> None:
    class Broken:
        def __enter__(self) -> None:
            raise RuntimeError("tracer bug")

        def __exit__(self, *exc: Any) -> bool:
            raise RuntimeError("tracer bug on exit")

    reporter = ErrorReporter()
    with Guarded(Broken(), reporter, "step"):
        pass
    with pytest.raises(KeyError), Guarded(Broken(), reporter, "step"):
        raise KeyError("user")
    assert reporter.counts["step"] >= 1
