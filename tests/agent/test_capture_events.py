"""The device-event path, driven by a fake backend (the same code runs with CUDA events)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from agent.capture.record import derive_wait
from agent.device_sampling import EVERY_STEP
from agent.recorder import Recorder
from agent.tracer import Tracer


class FakeEvent:
    __slots__ = ("seq", "t", "done")

    def __init__(self, seq: int, t: int) -> None:
        self.seq = seq
        self.t = t
        self.done = False


class FakeBackend:
    """Events stamped with host time; the test decides when the 'device' reaches them."""

    def __init__(self, cap: int = 1000) -> None:
        self.cap = cap
        self.live: set[int] = set()
        self.exhausted = 0
        self.marked: list[FakeEvent] = []
        self.released = 0
        self.peak_resets = 0

    def mark(self) -> Any | None:
        if len(self.live) >= self.cap:
            self.exhausted += 1
            return None
        ev = FakeEvent(len(self.marked), time.perf_counter_ns())
        self.marked.append(ev)
        self.live.add(ev.seq)
        return ev

    def done(self, event: FakeEvent) -> bool:
        return event.done

    def elapsed_ns(self, start: FakeEvent, end: FakeEvent) -> int:
        return end.t - start.t

    def release(self, event: FakeEvent) -> None:
        self.live.discard(event.seq)
        self.released += 1

    def reset_peak(self) -> None:
        self.peak_resets += 1

    def memory(self) -> tuple[int | None, int | None]:
        return 1234, 5678

    def complete_upto(self, seq: int) -> None:
        for ev in self.marked[: seq + 1]:
            ev.done = True


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.01)
        return self.fc(x)


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def tracer(recorder: Recorder, backend: FakeBackend) -> Iterator[Tracer]:
    t = Tracer(recorder, event_backend=backend, device_sampling=EVERY_STEP, event_timeout_s=3600)
    t.install()
    yield t
    t.uninstall()


def run_steps(tracer: Tracer, n: int) -> list[int]:
    """Run n steps; return the seq of each step's last event."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    backend: FakeBackend = tracer._backend  # type: ignore[assignment]
    last = []
    for _ in range(n):
        with tracer.trace_step(model):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
        last.append(len(backend.marked) - 1)
    return last


def test_rows_wait_for_events_and_resolve_head_of_line(tracer: Tracer, recorder: Recorder,
                                                       backend: FakeBackend) -> None:
    last = run_steps(tracer, 3)
    tracer.poll()
    assert "steps" not in recorder.drain()  # nothing completed on the device yet
    # Step 1's events complete but step 0's exit event does not: nothing may jump the queue.
    for ev in backend.marked[: last[1] + 1]:
        ev.done = True
    backend.marked[last[0]].done = False
    tracer.poll()
    assert "steps" not in recorder.drain()
    backend.complete_upto(last[1])
    tracer.poll()
    steps = recorder.drain()["steps"]
    assert steps["step"] == [0, 1]
    assert all(f >= 10_000_000 for f in steps["forward_ns"])  # device time between the forward events
    assert steps["peak_bytes"] == [1234, 1234] and steps["reserved_bytes"] == [5678, 5678]
    assert steps["h2d_ns"] == [0, 0]  # a device backend measures copies; none were made
    backend.complete_upto(last[2])
    tracer.poll()
    assert recorder.drain()["steps"]["step"] == [2]
    assert backend.live == set()  # every event went back to the pool
    assert backend.peak_resets == 3


def test_unresolved_events_are_dropped_after_the_bound(recorder: Recorder, backend: FakeBackend) -> None:
    tracer = Tracer(recorder, event_backend=backend, device_sampling=EVERY_STEP, event_timeout_s=0.0)
    tracer.install()
    try:
        run_steps(tracer, 2)
        time.sleep(0.001)
        tracer.poll()
    finally:
        tracer.uninstall()
    steps = recorder.drain()["steps"]
    assert steps["step"] == [0, 1]  # kept, with host timings
    assert all(f >= 10_000_000 for f in steps["forward_ns"])
    assert tracer.counters()["device_steps_dropped"] == 2
    assert backend.live == set()


def test_pool_exhaustion_falls_back_to_host_timing(recorder: Recorder) -> None:
    backend = FakeBackend(cap=3)
    tracer = Tracer(recorder, event_backend=backend, device_sampling=EVERY_STEP, event_timeout_s=3600)
    tracer.install()
    try:
        run_steps(tracer, 2)
        tracer.poll()
    finally:
        tracer.uninstall()
    assert recorder.drain()["steps"]["step"] == [0, 1]
    counters = tracer.counters()
    assert counters["events_exhausted"] > 0 and counters["device_steps_fallback"] >= 1
    assert backend.live == set()


def test_final_poll_does_not_wait_for_the_device(tracer: Tracer, recorder: Recorder) -> None:
    run_steps(tracer, 2)
    tracer.poll(final=True)
    assert recorder.drain()["steps"]["step"] == [0, 1]


def test_derive_wait_from_buckets() -> None:
    assert derive_wait(None) == (None, None)
    # two buckets: launched at 0 and 10, done at 30 and 25 -> comm 30+15, blocked 10..30
    assert derive_wait([(0, 30), (10, 25)]) == (45, 20)


def test_device_queue_is_bounded_oldest_leaves_with_host_timings(recorder: Recorder, backend: FakeBackend) -> None:
    # Nothing polls (a stuck sender thread) and the device never completes an event.
    tracer = Tracer(recorder, event_backend=backend, device_sampling=EVERY_STEP, event_timeout_s=3600, max_pending_steps=4)
    tracer.install()
    try:
        last = run_steps(tracer, 10)
        assert len(tracer._pending) == 4
        early = recorder.drain()["steps"]
        # The six oldest left at once, in order, with their host timings (no loss).
        assert early["step"] == [0, 1, 2, 3, 4, 5]
        assert all(f >= 10_000_000 for f in early["forward_ns"])
        counters = tracer.counters()
        assert counters["device_steps_overflow"] == 6
        assert counters["device_steps_dropped"] == 0 and counters["steps_dropped"] == 0
        # Their events went back to the pool; only the queued steps hold any.
        assert backend.live and min(backend.live) > last[5]
        backend.complete_upto(last[9])
        tracer.poll()
    finally:
        tracer.uninstall()
    assert recorder.drain()["steps"]["step"] == [6, 7, 8, 9]  # resolved from their device events
    assert backend.live == set()
    assert tracer.counters()["device_steps_overflow"] == 6


def copy(tracer: Tracer, ms: float) -> None:
    """What the Tensor.to/.cuda wrappers (capture.h2d, installed on CUDA machines) call around a copy."""
    token = tracer._h2d_begin()
    time.sleep(ms / 1000)
    tracer._h2d_end(token)


def test_copies_before_the_first_step_are_set_up_and_between_steps_the_next_steps(
        tracer: Tracer, recorder: Recorder, backend: FakeBackend) -> None:
    copy(tracer, 30)  # model.cuda() and friends, before any step
    run_steps(tracer, 1)
    copy(tracer, 5)  # a prefetch between steps feeds the next step
    last = run_steps(tracer, 1)
    backend.complete_upto(last[0])
    tracer.poll()
    steps = recorder.drain()["steps"]
    assert steps["h2d_ns"][0] == 0
    assert 5_000_000 <= steps["h2d_ns"][1] < 30_000_000
    assert steps["step_ns"][1] >= steps["h2d_ns"][1]  # the step is charged with its input's copy
    assert backend.live == set()  # the set-up copy's events went back to the pool


@pytest.mark.parametrize("cuda_in_use", [False, True])
def test_automatic_backend_is_kept_only_where_the_process_uses_cuda(
        monkeypatch: pytest.MonkeyPatch, recorder: Recorder, cuda_in_use: bool) -> None:
    """A GPU machine (faked: none here) running a CPU job keeps the host clock; a job
    whose model is on the GPU (CUDA initialized by then) times with device events."""
    import agent.tracer as tracer_module

    backend = FakeBackend()
    monkeypatch.setattr(tracer_module, "default_backend", lambda: backend)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: cuda_in_use)
    tracer = Tracer(recorder, event_timeout_s=3600)  # automatic backend
    tracer.install()
    try:
        last = run_steps(tracer, 2)
        if cuda_in_use:
            backend.complete_upto(last[-1])
        tracer.poll()
    finally:
        tracer.uninstall()
    steps = recorder.drain()["steps"]
    assert steps["step"] == [0, 1]
    if cuda_in_use:
        assert tracer._backend is backend and backend.marked
        assert steps["peak_bytes"] == [1234, 1234]
    else:
        assert tracer._backend is None and backend.marked == []  # no event was ever recorded
        assert steps["peak_bytes"] == [None, None]


def test_resolving_between_flushes_keeps_the_event_pool_from_running_out(recorder: Recorder) -> None:
    """A pool of three steps' events: resolved after every step (the sender thread's
    resolve_device between flushes), it never runs out; resolved only at the end (one
    flush), most steps lose their device timings."""
    per_step = 8  # events a CPU-side traced step records: enter, exit, three phase pairs
    for resolve_each_step in (True, False):
        backend = FakeBackend(cap=3 * per_step)
        tracer = Tracer(recorder, event_backend=backend, device_sampling=EVERY_STEP, event_timeout_s=3600)
        tracer.install()
        try:
            assert tracer.has_device_events
            model = Net()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(10):
                with tracer.trace_step(model):
                    model(torch.randn(2, 4)).sum().backward()
                    opt.step()
                backend.complete_upto(len(backend.marked) - 1)  # the device caught up
                if resolve_each_step:
                    tracer.resolve_device()
            tracer.poll()
            steps = recorder.drain()["steps"]
        finally:
            tracer.uninstall()
        assert steps["step"] == list(range(10))  # every step arrives either way
        if resolve_each_step:
            assert backend.exhausted == 0 and tracer.device_steps_fallback == 0
            assert steps["peak_bytes"] == [1234] * 10  # device rows, all of them
            assert len(backend.marked) == 10 * per_step and backend.live == set()
        else:
            assert backend.exhausted > 0 and tracer.device_steps_fallback >= 7


def test_a_host_only_tracer_has_nothing_to_resolve(recorder: Recorder) -> None:
    tracer = Tracer(recorder, event_backend=None)
    tracer.install()
    try:
        model = Net()
        with tracer.trace_step(model):
            model(torch.randn(2, 4)).sum().backward()
        assert not tracer.has_device_events
        tracer.resolve_device()
        assert "steps" not in recorder.drain()  # host rows go out with the flush's poll()
        tracer.poll()
        assert recorder.drain()["steps"]["step"] == [0]
    finally:
        tracer.uninstall()
