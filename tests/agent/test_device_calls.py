"""Device calls per step, counted on the training thread with the fake device backend:
a host-only step makes none; a sampled step records one event per phase boundary and
reads the allocator's peak once; no step ever synchronizes. A change that adds a call
to either kind of step fails here."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from agent.device_sampling import DeviceSamplingPolicy
from agent.recorder import Recorder
from agent.tracer import Tracer
from tests.agent.test_capture_events import FakeBackend

# The design's numbers for a step with forward, backward and an optimizer step.
SAMPLED_STEP = {"mark": 8, "reset_peak": 1, "memory": 1}  # enter, exit and a pair per phase
HOST_ONLY_STEP: dict[str, int] = {}  # nothing at all
EVERY = 4


class CountingBackend(FakeBackend):
    """The fake backend, counting each call the training thread makes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def mark(self) -> Any | None:
        self.calls["mark"] += 1
        return super().mark()

    def reset_peak(self) -> None:
        self.calls["reset_peak"] += 1
        super().reset_peak()

    def memory(self) -> tuple[int | None, int | None]:
        self.calls["memory"] += 1
        return super().memory()


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Tracer, CountingBackend, Recorder, Counter[str]]]:
    syncs: Counter[str] = Counter()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: syncs.update(["synchronize"]))
    backend = CountingBackend()
    recorder = Recorder()
    tracer = Tracer(recorder, event_backend=backend, event_timeout_s=3600,
                    device_sampling=DeviceSamplingPolicy(every=EVERY))
    tracer.install()
    yield tracer, backend, recorder, syncs
    tracer.uninstall()


def test_device_calls_per_sampled_and_host_only_step(counted: tuple[Tracer, CountingBackend, Recorder, Counter[str]]
                                                     ) -> None:
    tracer, backend, recorder, syncs = counted
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    per_step: list[dict[str, int]] = []
    for _ in range(3 * EVERY):
        before = Counter(backend.calls)
        with tracer.trace_step(model):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        per_step.append(dict(backend.calls - before))
    sampled = [i % EVERY == 0 for i in range(3 * EVERY)]
    assert per_step == [SAMPLED_STEP if s else HOST_ONLY_STEP for s in sampled]
    assert syncs["synchronize"] == 0

    backend.complete_upto(len(backend.marked) - 1)
    tracer.poll()
    rows = recorder.drain()["steps"]
    assert rows["step"] == list(range(3 * EVERY))
    assert rows["device_timed"] == [1 if s else 0 for s in sampled]
    for i, s in enumerate(sampled):
        assert rows["step_ns"][i] is not None and rows["step_ns"][i] > 0  # every step keeps its length
        device_fields = (rows["forward_ns"][i], rows["backward_ns"][i], rows["optimizer_ns"][i], rows["peak_bytes"][i])
        if s:
            assert None not in device_fields
        else:  # host times there would be launch times: left empty, never mixed in
            assert device_fields == (None, None, None, None)
    assert backend.live == set()  # every event went back to the pool
    assert tracer.counters()["device_steps_fallback"] == 0  # host-only by choice is not a fallback
