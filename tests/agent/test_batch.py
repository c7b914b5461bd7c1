"""The batch builder's between-flush device resolution (the rest of a batch is covered
end to end in test_runtime.py)."""

from __future__ import annotations

import pytest
import torch

from agent.batch import BatchBuilder
from agent.device_sampling import EVERY_STEP
from agent.errors import ErrorReporter
from agent.recorder import Recorder
from agent.tracer import Tracer
from tests.agent.test_capture_events import FakeBackend, Net


def _builder(recorder: Recorder, tracer: object) -> BatchBuilder:
    return BatchBuilder(recorder, tracer, is_node_leader=lambda: False, counters=dict,  # type: ignore[arg-type]
                        reporter=ErrorReporter(), sample_gpus=False)


def test_resolve_emits_the_steps_whose_events_completed() -> None:
    recorder = Recorder()
    backend = FakeBackend()
    tracer = Tracer(recorder, event_backend=backend, device_sampling=EVERY_STEP, event_timeout_s=3600)
    tracer.install()
    try:
        builder = _builder(recorder, tracer)
        assert builder.resolves_device
        model = Net()
        with tracer.trace_step(model):
            model(torch.randn(2, 4)).sum().backward()
        builder.resolve()
        assert "steps" not in recorder.drain()  # the device has not reached the step's events
        backend.complete_upto(len(backend.marked) - 1)
        builder.resolve()
        assert recorder.drain()["steps"]["step"] == [0]
        assert backend.live == set()
    finally:
        tracer.uninstall()


def test_a_host_tracer_or_none_wants_no_resolving() -> None:
    recorder = Recorder()
    assert not _builder(recorder, None).resolves_device
    assert not _builder(recorder, Tracer(recorder, event_backend=None)).resolves_device
    _builder(recorder, None).resolve()  # nothing to do, nothing raised


def test_a_failing_tracer_is_reported_not_raised(capsys: pytest.CaptureFixture[str]) -> None:
    class Broken:
        has_device_events = True

        def resolve_device(self) -> None:
            raise RuntimeError("boom")

    builder = _builder(Recorder(), Broken())
    builder.resolve()
    assert "boom" in capsys.readouterr().err


def test_loss_counters_go_out_when_they_change_and_on_a_refresh() -> None:
    from agent.batch import COUNTERS_REFRESH_FLUSHES

    counts = {"recorder_rows": 0, "sender_batches": 0}
    builder = BatchBuilder(Recorder(), None, is_node_leader=lambda: False, counters=lambda: dict(counts),
                           reporter=ErrorReporter(), sample_gpus=False)

    def sent(final: bool = False) -> dict[str, int] | None:
        tables = builder.build(0.0, final=final)
        assert tables["status"]["ts"] == [0.0]  # status and process rows go out every flush
        drops = tables.get("drops")
        return None if drops is None else dict(zip(drops["source"], drops["count"], strict=True))

    assert sent() == {"recorder_rows": 0, "sender_batches": 0}  # the first flush: the whole set
    assert sent() is None  # nothing changed
    counts["sender_batches"] = 3
    assert sent() == {"recorder_rows": 0, "sender_batches": 3}  # a change sends the whole set
    flushes = [sent() for _ in range(COUNTERS_REFRESH_FLUSHES)]
    assert flushes[:-1] == [None] * (COUNTERS_REFRESH_FLUSHES - 1)
    assert flushes[-1] == {"recorder_rows": 0, "sender_batches": 3}  # the refresh
    builder.resend_models()  # a reconnect
    assert sent() == {"recorder_rows": 0, "sender_batches": 3}
    assert sent() is None
    assert sent(final=True) == {"recorder_rows": 0, "sender_batches": 3}  # the last flush always carries them
