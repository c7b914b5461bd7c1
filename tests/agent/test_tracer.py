"""Step capture on CPU with real torch: phase attribution, models, scalars, fail-open."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from agent.capture.model import TimedCall
from agent.recorder import Recorder
from agent.tracer import Tracer

MS = 1_000_000


class SleepyDataset(Dataset[torch.Tensor]):
    def __init__(self, n: int, sleep_s: float, on_get: Any = None) -> None:
        self.n = n
        self.sleep_s = sleep_s
        self.on_get = on_get

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.on_get is not None:
            self.on_get()
        time.sleep(self.sleep_s)
        return torch.full((4,), float(i))


class SlowBackward(torch.autograd.Function):
    sleep_s = 0.0
    on_backward: Any = None

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if SlowBackward.on_backward is not None:
            SlowBackward.on_backward()
        time.sleep(SlowBackward.sleep_s)
        return grad


class Net(torch.nn.Module):
    def __init__(self, fwd_sleep_s: float = 0.0, bwd_sleep_s: float = 0.0, on_forward: Any = None) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.act = torch.nn.ReLU(inplace=True)
        self.fc2 = torch.nn.Linear(8, 1)
        self.fwd_sleep_s = fwd_sleep_s
        self.bwd_sleep_s = bwd_sleep_s
        self.on_forward = on_forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.on_forward is not None:
            self.on_forward()
        time.sleep(self.fwd_sleep_s)
        h = self.act(self.fc1(x))
        if self.bwd_sleep_s:
            SlowBackward.sleep_s = self.bwd_sleep_s
            h = SlowBackward.apply(h)
        return self.fc2(h)


class SlowSGD(torch.optim.SGD):
    def __init__(self, params: Any, sleep_s: float, on_step: Any = None) -> None:
        super().__init__(params, lr=0.01)
        self.sleep_s = sleep_s
        self.on_step = on_step

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if self.on_step is not None:
            self.on_step()
        time.sleep(self.sleep_s)
        return super().step(closure)


@pytest.fixture
def tracer(tracer: Tracer) -> Iterator[Tracer]:
    """conftest's Tracer, with SlowBackward's knobs reset after the test."""
    yield tracer
    SlowBackward.sleep_s = 0.0
    SlowBackward.on_backward = None


def steps_of(tracer: Tracer, recorder: Recorder) -> list[dict[str, Any]]:
    tracer.poll()  # the sender thread's job: finished steps become rows there
    table = recorder.drain().get("steps", {})
    n = len(table.get("step", []))
    return [{k: v[i] for k, v in table.items()} for i in range(n)]


def test_every_phase_is_attributed(tracer: Tracer, recorder: Recorder) -> None:
    model = Net(fwd_sleep_s=0.03, bwd_sleep_s=0.04)
    opt = SlowSGD(model.parameters(), sleep_s=0.025)
    loader = DataLoader(SleepyDataset(3, 0.02), batch_size=1)
    for batch in loader:
        with tracer.trace_step(model):
            model(batch).sum().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.015)  # unattributed work: the residual wait
    rows = steps_of(tracer, recorder)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["dataloader_ns"] >= 20 * MS
        assert r["forward_ns"] >= 30 * MS
        assert r["backward_ns"] >= 40 * MS
        assert r["optimizer_ns"] >= 25 * MS
        assert r["wait_ns"] >= 15 * MS
        parts = r["dataloader_ns"] + r["forward_ns"] + r["backward_ns"] + r["optimizer_ns"] + r["wait_ns"]
        assert parts == r["step_ns"]  # residual wait closes the sum exactly
        # No DDP: comm not measured. H2D is measured (0 here) only where CUDA exists at all.
        assert r["h2d_ns"] == (0 if torch.cuda.is_available() else None) and r["comm_ns"] is None
        assert r["peak_bytes"] is None and r["model_id"] == 0


def test_backward_time_does_not_leak_into_forward(tracer: Tracer, recorder: Recorder) -> None:
    model = Net(bwd_sleep_s=0.08)
    with tracer.trace_step(model):
        model(torch.randn(2, 4)).sum().backward()
    (row,) = steps_of(tracer, recorder)
    assert row["backward_ns"] >= 80 * MS
    assert row["forward_ns"] < 80 * MS
    assert row["dataloader_ns"] is None  # no DataLoader in this process run: not measured


def test_validation_loader_between_steps_does_not_leak(tracer: Tracer, recorder: Recorder) -> None:
    model = Net()
    train = DataLoader(SleepyDataset(4, 0.0), batch_size=1)
    val = DataLoader(SleepyDataset(3, 0.1), batch_size=1)
    for i, batch in enumerate(train):
        if i == 2:  # validation after the training fetch, before the step enters
            for vb in val:
                model(vb)
        with tracer.trace_step(model):
            model(batch).sum().backward()
        if i == 0:  # and validation after a step, before the next training fetch
            for vb in val:
                model(vb)
    rows = steps_of(tracer, recorder)
    assert len(rows) == 4
    for r in rows:
        assert r["dataloader_ns"] is not None
        assert r["dataloader_ns"] < 100 * MS, r  # one val fetch alone sleeps 100 ms


def test_two_models_have_their_own_steps(tracer: Tracer, recorder: Recorder) -> None:
    gen = Net(fwd_sleep_s=0.02)
    disc = Net()
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.01)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.01)
    for _ in range(3):
        z = torch.randn(2, 4)
        with tracer.trace_step(disc):
            # the generator runs inside the discriminator's step: its forward counts there
            disc(gen(z).detach().expand(2, 4)).sum().backward()
            opt_d.step()
        with tracer.trace_step(gen):
            disc(gen(z).expand(2, 4)).sum().backward()
            opt_g.step()
    tracer.poll()
    tables = recorder.drain()
    models = tables["models"]
    assert models["model_id"] == [0, 1]
    assert models["parallelism"] == ["single", "single"]
    steps = tables["steps"]
    by_model: dict[int, list[int]] = {}
    for mid, step in zip(steps["model_id"], steps["step"], strict=True):
        by_model.setdefault(mid, []).append(step)
    assert by_model == {0: [0, 1, 2], 1: [0, 1, 2]}
    # Once the generator is known (its first traced step), its forward also counts
    # inside the discriminator's step; before that only traced models are hooked.
    for mid, step, fwd in zip(steps["model_id"], steps["step"], steps["forward_ns"], strict=True):
        if mid == 1 or step > 0:
            assert fwd >= 20 * MS
    assert tracer.status()["steps_done"] == 6


def test_dataloader_with_forked_workers(tracer: Tracer, recorder: Recorder) -> None:
    model = Net()
    loader = DataLoader(SleepyDataset(8, 0.03), batch_size=2, num_workers=2, multiprocessing_context="fork")
    for batch in loader:
        with tracer.trace_step(model):
            model(batch).sum().backward()
    rows = steps_of(tracer, recorder)
    assert len(rows) == 4
    # The first batch needs two 30 ms items from a freshly forked worker.
    assert rows[0]["dataloader_ns"] >= 30 * MS
    assert all(r["dataloader_ns"] > 0 for r in rows)


def test_only_the_traced_module_is_instrumented(tracer: Tracer) -> None:
    model = Net()
    with tracer.trace_step(model):
        model(torch.randn(2, 4)).sum().backward()
    # One wrapped _call_impl in the model's own dict, no hooks: torch's _call_impl keeps its fast path.
    assert isinstance(model.__dict__.get("_call_impl"), TimedCall)
    assert not model._forward_pre_hooks and not model._forward_hooks
    for sub in [model.fc1, model.act, model.fc2]:
        assert not sub._forward_pre_hooks and not sub._forward_hooks and "_call_impl" not in sub.__dict__
    wrapped = model.__dict__["_call_impl"]
    with tracer.trace_step(model):  # instrumented once per model
        model(torch.randn(2, 4))
    assert model.__dict__["_call_impl"] is wrapped


def test_status_follows_the_phases(recorder: Recorder) -> None:
    tracer = Tracer(recorder, event_backend=None)
    tracer.install()
    seen: dict[str, str] = {}

    def note(where: str) -> Any:
        return lambda: seen.setdefault(where, tracer.status()["phase"])

    try:
        model = Net(bwd_sleep_s=0.001, on_forward=note("forward"))
        SlowBackward.on_backward = note("backward")
        opt = SlowSGD(model.parameters(), 0.0, on_step=note("optimizer"))
        loader = DataLoader(SleepyDataset(2, 0.0, on_get=note("dataloader")), batch_size=1)
        for batch in loader:
            with tracer.trace_step(model):
                model(batch).sum().backward()
                opt.step()
        status = tracer.status()
    finally:
        tracer.uninstall()
        SlowBackward.on_backward = None
    assert seen == {"dataloader": "dataloader", "forward": "forward", "backward": "backward",
                    "optimizer": "optimizer"}
    assert status["phase"] == "idle" and status["step"] == 1 and status["steps_done"] == 2
    assert abs(status["phase_since"] - time.time()) < 60  # wall-clock seconds, not perf ns


def test_tensor_scalars_are_resolved_in_poll_not_on_the_training_thread(
    tracer: Tracer, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[int] = []
    real_item = torch.Tensor.item

    def item(self: torch.Tensor) -> Any:
        threads.append(threading.get_ident())
        return real_item(self)

    monkeypatch.setattr(torch.Tensor, "item", item)
    model = Net()
    with tracer.trace_step(model):
        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
    tracer.log(loss=loss, lr=0.5)
    assert recorder.drain()["scalars"] == {"step": [0], "name": ["lr"], "value": [0.5]}
    assert threads == []
    poller = threading.Thread(target=tracer.poll)
    poller.start()
    poller.join()
    scalars = recorder.drain()["scalars"]
    assert scalars["name"] == ["loss"] and scalars["step"] == [0]
    assert scalars["value"][0] == pytest.approx(real_item(loss))
    assert threads and threading.get_ident() not in threads


def test_spans_and_instants(tracer: Tracer, recorder: Recorder) -> None:
    before = time.time_ns()
    with tracer.span("eval", epoch=3):
        time.sleep(0.002)
    tracer.instant("checkpoint", path="/tmp/x")
    spans = recorder.drain()["spans"]
    assert spans["name"] == ["eval", "checkpoint"]
    assert spans["args"] == ['{"epoch": 3}', '{"path": "/tmp/x"}']
    assert spans["dur_ns"][0] >= 2 * MS and spans["dur_ns"][1] is None
    assert spans["start_ns"][0] >= before


def test_failed_step_emits_no_row_and_does_not_swallow(tracer: Tracer, recorder: Recorder) -> None:
    model = Net()
    with pytest.raises(ValueError), tracer.trace_step(model):
        raise ValueError("user bug")
    with tracer.trace_step(model):
        model(torch.randn(2, 4))
    rows = steps_of(tracer, recorder)
    assert [r["step"] for r in rows] == [0]


class BrokenRecorder(Recorder):
    def add(self, table: str, row: dict[str, Any]) -> None:
        raise RuntimeError("recorder is broken")


def test_nothing_raises_into_user_code() -> None:
    warnings: list[str] = []
    kinds: list[str] = []

    def warn(kind: str, msg: str) -> None:
        kinds.append(kind)
        warnings.append(msg)

    tracer = Tracer(BrokenRecorder(), warn=warn, event_backend=None)
    tracer.install()
    try:
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for batch in DataLoader(SleepyDataset(3, 0.0), batch_size=1):
            with tracer.trace_step(model):
                loss = model(batch).sum()
                loss.backward()
                opt.step()
            tracer.log(loss=loss, x=1.0)
            with tracer.span("s"):
                pass
            tracer.instant("i")
        tracer.poll()
        tracer.log(bad="not a number")  # type: ignore[arg-type]
        assert tracer.status()["steps_done"] == 3
    finally:
        tracer.uninstall()
    # The printer adds the one "[traceml]" prefix; each kind is warned once, then only counted.
    assert warnings and not any("[traceml]" in w for w in warnings)
    assert len(kinds) == len(set(kinds)) and "recorder" in kinds
    assert tracer.counters()["tracer_errors"] > len(warnings)


def test_deep_dive_is_sampled_and_unhooked(recorder: Recorder) -> None:
    tracer = Tracer(recorder, deep_dive=True, deep_dive_every=2, event_backend=None)
    tracer.install()
    try:
        model = Net()
        for i in range(4):
            with tracer.trace_step(model):
                model(torch.randn(2, 4)).sum().backward()
                hooked = len(model.fc1._forward_hooks)
            assert hooked == (1 if i % 2 == 0 else 0)
            assert not model.fc1._forward_hooks and not model.fc1._forward_pre_hooks
    finally:
        tracer.uninstall()
    layers = recorder.drain()["layers"]
    assert layers["step"] == [0, 0, 0, 2, 2, 2]
    assert layers["layer"][:3] == ["fc1", "act", "fc2"]
    assert layers["activation_bytes"][:3] == [2 * 8 * 4, 2 * 8 * 4, 2 * 1 * 4]
    assert all(v is not None and v >= 0 for v in layers["backward_ns"])


def test_uninstall_restores_everything(recorder: Recorder) -> None:
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    backward = torch.autograd.backward
    next_ = _BaseDataLoaderIter.__next__
    tracer = Tracer(recorder, event_backend=None)
    tracer.install()
    tracer.install()  # idempotent
    model = Net()
    with tracer.trace_step(model):
        model(torch.randn(2, 4))
    assert torch.autograd.backward is not backward
    tracer.uninstall()
    assert torch.autograd.backward is backward
    assert _BaseDataLoaderIter.__next__ is next_
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert "_call_impl" not in model.__dict__


def test_each_tracer_error_kind_prints_once_with_one_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    from agent.config import load_config
    from agent.errors import ErrorReporter
    from agent.rank_runtime import Runtime

    config, _ = load_config({"TRACEML_NO_RELAY": "1"})
    runtime = Runtime(config, env={}, reporter_=ErrorReporter())
    try:
        gate = runtime.tracer._gate
        for _ in range(3):
            gate.fail("forward", RuntimeError("a"))
            gate.fail("backward", RuntimeError("b"))
    finally:
        runtime.tracer.uninstall()
    lines = [line for line in capsys.readouterr().err.splitlines() if "tracer" in line]
    assert len(lines) == 2  # one per kind: the second kind is not hidden behind the first
    assert all(line.startswith("[traceml] tracer ") and line.count("[traceml]") == 1 for line in lines)
    assert runtime.tracer.counters()["tracer_errors"] == 6


def test_tracer_counters_reach_the_drops_rows(recorder: Recorder) -> None:
    from agent.batch import BatchBuilder
    from agent.errors import ErrorReporter

    tracer = Tracer(recorder, event_backend=None)
    tracer._gate.fail("forward", RuntimeError("x"))
    tracer._scalars.dropped = 3
    builder = BatchBuilder(recorder, tracer, is_node_leader=lambda: False, counters=lambda: {"recorder_rows": 0},
                           reporter=ErrorReporter(), sample_gpus=False)
    drops = builder.build(time.time(), final=False)["drops"]
    got = dict(zip(drops["source"], drops["count"], strict=True))
    assert got["tracer_errors"] == 1 and got["scalars_dropped"] == 3
    assert {"device_steps_dropped", "device_steps_fallback", "recorder_rows"} <= set(got)
    assert all(isinstance(v, int) for v in got.values())  # the daemon stores int counts only


def test_finished_steps_become_rows_on_poll_and_the_queue_is_bounded(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    import agent.tracer as tracer_mod

    monkeypatch.setattr(tracer_mod, "MAX_PENDING_STEPS", 3)  # the queue's bound is fixed at construction
    tracer = Tracer(recorder, event_backend=None)
    tracer.install()
    try:
        model = Net()
        for _ in range(5):
            with tracer.trace_step(model):
                model(torch.randn(2, 4))
        assert "steps" not in recorder.drain()  # the training thread built no row
        rows = steps_of(tracer, recorder)
        assert [r["step"] for r in rows] == [2, 3, 4]  # the oldest were dropped, not the newest
        assert tracer.counters()["steps_dropped"] == 2
        assert tracer.status()["steps_done"] == 5
        for _ in range(2):  # polled in time: nothing more is dropped, and the count never goes back
            with tracer.trace_step(model):
                model(torch.randn(2, 4))
        assert [r["step"] for r in steps_of(tracer, recorder)] == [5, 6]
        assert tracer.counters()["steps_dropped"] == 2
    finally:
        tracer.uninstall()


def test_public_trace_step_reuses_one_context_and_stays_fail_open(monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.config import load_config
    from agent.errors import ErrorReporter
    from agent.rank_runtime import Runtime

    config, _ = load_config({"TRACEML_NO_RELAY": "1"})
    runtime = Runtime(config, env={}, reporter_=ErrorReporter())
    runtime._settled = True  # no sender thread in this test: skip the hello poke
    runtime.tracer.install()
    try:
        model = Net()
        first = runtime.trace_step(model)
        assert runtime.trace_step(model) is first  # nothing allocated per step
        with pytest.raises(ValueError), runtime.trace_step(model):
            raise ValueError("user bug")  # the user's exception passes through unchanged

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("tracer bug")

        monkeypatch.setattr(type(runtime.tracer), "_take_fetch", broken)  # a slotted class: patch the method
        runtime.tracer._fetches[1] = (1, 5)  # another loader's fetch: forces the broken branch on enter
        runtime.tracer._rare = True
        with runtime.trace_step(model):  # the tracer's own error never reaches the user
            model(torch.randn(2, 4))
        assert runtime.tracer.counters()["tracer_errors"] >= 1
    finally:
        runtime.tracer.uninstall()


def test_public_trace_step_looks_the_model_up_without_the_runtime_once_settled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import agent
    from agent import runtime

    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TRACEML_DISABLE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TRACEML_NO_RELAY", "1")
    monkeypatch.setenv("TRACEML_DAEMON", "127.0.0.1:9")
    monkeypatch.setattr(runtime, "_initialized", False)
    monkeypatch.setattr(runtime, "disabled", False)
    agent.init()
    try:
        model = Net()
        first = agent.trace_step(model)  # the slow path: settles, registers the model, publishes
        assert runtime.fast_models is not None

        def no_runtime(model: Any) -> Any:
            raise AssertionError("the runtime was asked")

        slow_path = runtime.step_context
        runtime.step_context = no_runtime
        try:
            with agent.trace_step(model) as entered:
                assert entered is None
                model(torch.randn(2, 4)).sum().backward()
            assert agent.trace_step(model) is first
        finally:
            runtime.step_context = slow_path
        other = Net()  # a new model misses the lookup: registered through the runtime
        assert agent.trace_step(other) is not first
    finally:
        agent.shutdown()
    assert runtime.fast_models is None
    assert agent.trace_step(model) is runtime.NULL_CONTEXT  # after shutdown: a no-op context
