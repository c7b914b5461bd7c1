"""agent.capture.autograd: the backward wrapper, fast (torch's known signature) and generic."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import agent.capture.autograd as capture_autograd
from agent.recorder import Recorder
from agent.tracer import Tracer

MS = 1_000_000


class SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(0.03)
        return grad * 2


class FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("the user's backward failed")


def rows(tracer: Tracer, recorder: Recorder) -> list[dict[str, Any]]:
    tracer.poll()
    table = recorder.drain().get("steps", {})
    return [{k: v[i] for k, v in table.items()} for i in range(len(table.get("step", [])))]


@pytest.fixture(params=["fast", "generic"])
def traced(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Tracer, Recorder]]:
    if request.param == "generic":  # as on a torch whose backward has another signature
        monkeypatch.setattr(capture_autograd, "takes_known_params", lambda fn: False)
    recorder = Recorder()
    tracer = Tracer(recorder, event_backend=None)
    tracer.install()
    try:
        yield tracer, recorder
    finally:
        tracer.uninstall()


def test_this_torch_gets_the_fast_wrapper() -> None:
    assert capture_autograd.takes_known_params(torch.autograd.backward)
    tracer = Tracer(Recorder(), event_backend=None)
    tracer.install()
    try:
        params = list(torch.autograd.backward.__code__.co_varnames[:6])
        assert params == list(capture_autograd.KNOWN_PARAMS)
    finally:
        tracer.uninstall()


def test_both_spellings_time_backward_and_keep_their_arguments(traced: tuple[Tracer, Recorder]) -> None:
    tracer, recorder = traced
    model = torch.nn.Linear(3, 1)
    w = torch.ones(3, requires_grad=True)
    with tracer.trace_step(model):  # Tensor.backward, which passes ``inputs`` by name
        SleepInBackward.apply(model(torch.ones(2, 3))).sum().backward()
    with tracer.trace_step(model):  # the function, arguments by name
        out = SleepInBackward.apply((w * w).sum())
        torch.autograd.backward([out], grad_tensors=[torch.tensor(3.0)], retain_graph=True, inputs=[w])
    assert w.grad is not None and torch.equal(w.grad, torch.full((3,), 12.0))  # 3 * 2 * 2w
    assert model.weight.grad is not None
    first, second = rows(tracer, recorder)
    assert first["backward_ns"] >= 30 * MS and second["backward_ns"] >= 30 * MS
    assert first["forward_ns"] < 30 * MS


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph")
def test_create_graph_passes_through(traced: tuple[Tracer, Recorder]) -> None:
    tracer, recorder = traced
    x = torch.tensor(2.0, requires_grad=True)
    with tracer.trace_step(None):
        torch.autograd.backward(x**3, create_graph=True)
    assert x.grad is not None and x.grad.requires_grad  # d(x^3)/dx = 3x^2 = 12, differentiable
    assert float(x.grad.detach()) == 12.0
    x.grad = None  # the graph kept by create_graph holds x: drop it
    assert len(rows(tracer, recorder)) == 1


def test_a_failing_backward_closes_the_phase_and_raises_unchanged(traced: tuple[Tracer, Recorder]) -> None:
    tracer, recorder = traced
    model = torch.nn.Linear(3, 1)
    with pytest.raises(ValueError, match="the user's backward failed"):
        with tracer.trace_step(model):
            FailInBackward.apply(model(torch.ones(1, 3))).sum().backward()
    with tracer.trace_step(model):  # the next step is timed as usual
        SleepInBackward.apply(model(torch.ones(1, 3))).sum().backward()
    (row,) = rows(tracer, recorder)  # the failed step leaves no row
    assert row["backward_ns"] >= 30 * MS


def test_outside_a_step_the_wrapper_passes_straight_through(traced: tuple[Tracer, Recorder]) -> None:
    tracer, recorder = traced
    x = torch.tensor(1.5, requires_grad=True)
    torch.autograd.backward(x * 4)
    assert float(x.grad) == 4.0
    assert rows(tracer, recorder) == []


def test_signature_check() -> None:
    def renamed(tensors: Any, grads: Any = None) -> None: ...

    def other_default(tensors: Any, grad_tensors: Any = None, retain_graph: Any = None, create_graph: Any = True,
                      grad_variables: Any = None, inputs: Any = None) -> None: ...

    def keyword_only(*, tensors: Any, grad_tensors: Any = None, retain_graph: Any = None, create_graph: Any = False,
                     grad_variables: Any = None, inputs: Any = None) -> None: ...

    def added(tensors: Any, grad_tensors: Any = None, retain_graph: Any = None, create_graph: Any = False,
              grad_variables: Any = None, inputs: Any = None, *, flag: bool = False) -> None: ...

    assert not capture_autograd.takes_known_params(renamed)
    assert not capture_autograd.takes_known_params(other_default)
    assert not capture_autograd.takes_known_params(keyword_only)
    assert not capture_autograd.takes_known_params(len)  # no signature to read: generic
    assert capture_autograd.takes_known_params(added)


def test_parameters_a_later_torch_adds_are_passed_on(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[Any, ...]] = []

    def later_backward(tensors: Any, grad_tensors: Any = None, retain_graph: Any = None, create_graph: Any = False,
                       grad_variables: Any = None, inputs: Any = None, *, flag: bool = False) -> None:
        seen.append((tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs, flag))

    monkeypatch.setattr(torch.autograd, "backward", later_backward)
    recorder = Recorder()
    tracer = Tracer(recorder, event_backend=None)
    tracer.install()
    try:
        assert torch.autograd.backward is not later_backward
        with tracer.trace_step(None):
            torch.autograd.backward("t", flag=True)
            torch.autograd.backward("u", None, True)
        torch.autograd.backward("v", flag=True)  # outside a step too
    finally:
        tracer.uninstall()
    assert torch.autograd.backward is later_backward
    assert seen == [("t", None, None, False, None, None, True), ("u", None, True, False, None, None, False),
                    ("v", None, None, False, None, None, True)]
