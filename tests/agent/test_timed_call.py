"""The traced model's forward timed by a ``_call_impl`` wrapper in its instance dict.

``agent.capture.model.TimedCall`` replaces two forward hooks so that torch's
``nn.Module._call_impl`` keeps its fast path; these tests pin what the hooks gave
for free: copies, pickling, exceptions, nesting, other hooks' time, removal,
``model.compile()``, and the fall-back to hooks.
"""

from __future__ import annotations

import copy
import gc
import inspect
import io
import pickle
import time
import weakref
from typing import Any

import pytest
import torch

from agent.capture.model import TimedCall
from agent.recorder import Recorder
from agent.tracer import Tracer

MS = 1_000_000


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)
        self.fail = False

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        if self.fail:
            raise ValueError("boom")
        return self.fc(x) * scale


def steps(tracer: Tracer, recorder: Recorder) -> dict[str, list[Any]]:
    tracer.poll()
    return recorder.drain()["steps"]


def test_wrapper_times_forward_and_keeps_the_fast_path(tracer: Tracer, recorder: Recorder) -> None:
    model = Small()
    x = torch.randn(3, 4)
    expected = model(x, scale=2.0)
    with tracer.trace_step(model):
        out = model(x, scale=2.0)  # keyword arguments pass through
    assert torch.equal(out, expected)
    assert isinstance(model.__dict__["_call_impl"], TimedCall)
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert "forward" not in model.__dict__  # forward itself is left alone
    rows = steps(tracer, recorder)
    assert rows["forward_ns"][0] > 0
    # Outside a step the wrapper passes through and records nothing.
    assert torch.equal(model(x, scale=2.0), expected)


def test_forward_called_directly_is_not_captured_as_with_hooks(tracer: Tracer, recorder: Recorder) -> None:
    # The daemon reports a forward that is never measured (INCOMPLETE_DATA); calling
    # model.forward(x) bypasses module hooks, and it bypasses this wrapper alike.
    model = Small()
    with tracer.trace_step(model):
        model.forward(torch.randn(1, 4))
    assert steps(tracer, recorder)["forward_ns"] == [0]


def test_other_forward_hooks_count_as_forward(tracer: Tracer, recorder: Recorder) -> None:
    # FSDP-style pre-forward work in a hook registered before or after tracing starts.
    model = Small()
    model.register_forward_pre_hook(lambda m, a: time.sleep(0.003), prepend=True)
    with tracer.trace_step(model):
        model(torch.randn(1, 4))
    model.register_forward_hook(lambda m, a, o: time.sleep(0.003))
    with tracer.trace_step(model):
        model(torch.randn(1, 4))
    assert isinstance(model.__dict__["_call_impl"], TimedCall)
    fwd = steps(tracer, recorder)["forward_ns"]
    assert fwd[0] >= 3 * MS and fwd[1] >= 6 * MS


def test_exception_in_forward_closes_the_phase(tracer: Tracer, recorder: Recorder) -> None:
    model = Small()
    model.fail = True
    with pytest.raises(ValueError, match="boom"):
        with tracer.trace_step(model):
            model(torch.randn(1, 4))
    model.fail = False
    with tracer.trace_step(model):
        assert tracer.status()["phase"] == "wait"  # not stuck in forward
        model(torch.randn(1, 4))
    rows = steps(tracer, recorder)
    assert rows["step"] == [0] and rows["forward_ns"][0] > 0
    assert tracer.counters()["tracer_errors"] == 0


def test_nested_models_count_once(tracer: Tracer) -> None:
    inner = Small()
    outer = Small()
    with tracer.trace_step(outer):
        with tracer.trace_step(inner):  # registers inner; nested in outer's step
            pass
        outer(torch.randn(1, 4))
        inner(torch.randn(1, 4))
        assert tracer._active is not None and tracer._active.fwd_depth == 0
    assert tracer.counters()["tracer_errors"] == 0


def test_deepcopy_runs_the_copy_with_its_own_weights(tracer: Tracer, recorder: Recorder) -> None:
    model = Small()
    with tracer.trace_step(model):
        model(torch.randn(1, 4))
    ema = copy.deepcopy(model)
    with torch.no_grad():
        ema.fc.weight.zero_()
        ema.fc.bias.fill_(1.0)
    x = torch.randn(2, 4)
    assert torch.equal(ema(x), torch.ones(2, 2))  # the copy's weights, not the original's
    assert not torch.equal(model(x), torch.ones(2, 2))
    assert isinstance(ema.__dict__["_call_impl"], TimedCall)
    assert ema.__dict__["_call_impl"] is not model.__dict__["_call_impl"]
    # Like copied hooks: the copy's forward inside a step counts as forward.
    with tracer.trace_step(model):
        ema(x)
    assert steps(tracer, recorder)["forward_ns"][-1] > 0


def test_pickled_model_loads_untraced(tracer: Tracer) -> None:
    model = Small()
    with tracer.trace_step(model):
        model(torch.randn(1, 4))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    x = torch.randn(2, 4)
    assert torch.equal(loaded(x), model(x))
    assert not isinstance(loaded.__dict__.get("_call_impl"), TimedCall)
    assert isinstance(pickle.loads(pickle.dumps(model)), Small)


def test_introspection_is_unchanged(tracer: Tracer) -> None:
    model = Small()
    before = inspect.signature(model.forward)
    with tracer.trace_step(model):
        pass
    assert inspect.signature(model.forward) == before
    assert model.forward.__func__ is Small.forward  # libraries that re-wrap forward.__func__


def test_uninstall_removes_it_and_a_compiled_call_keeps_working(recorder: Recorder) -> None:
    tracer = Tracer(recorder, event_backend=None)
    tracer.install()
    model = Small()
    with tracer.trace_step(model):
        pass
    ours = model.__dict__["_call_impl"]
    model._compiled_call_impl = ours  # what model.compile() would capture: still called after uninstall
    tracer.uninstall()
    assert "_call_impl" not in model.__dict__
    x = torch.randn(1, 4)
    assert torch.equal(model(x), Small.forward(model, x))  # passes through


def test_the_model_is_not_kept_alive_by_its_wrapper(tracer: Tracer) -> None:
    model = Small()
    with tracer.trace_step(model):
        pass
    ref = weakref.ref(model)
    gc.disable()  # freed by reference counting alone: no cycle through the wrapper
    try:
        del model
        assert ref() is None
    finally:
        gc.enable()


def test_a_class_with_its_own_call_keeps_hooks(tracer: Tracer, recorder: Recorder) -> None:
    class OwnCall(Small):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:  # like torch.compile's OptimizedModule
            return super().__call__(*args, **kwargs)

    model = OwnCall()
    with tracer.trace_step(model):
        model(torch.randn(1, 4))
    assert "_call_impl" not in model.__dict__
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1
    assert steps(tracer, recorder)["forward_ns"][0] > 0
