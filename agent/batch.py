"""What one flush puts in a batch: the tracer's rows plus the sampled state.

Runs on the sender thread. Order matters: ``tracer.poll()`` first (it resolves
finished CUDA events and lazy scalars into recorder rows), then the status,
process, host/GPU and drop-counter rows, then one drain of the recorder so a
batch is a consistent cut.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from agent.errors import ErrorReporter
from agent.recorder import Recorder
from agent.samplers import GpuSampler, Nvml, ProcessSampler, SystemSampler

Tables = dict[str, dict[str, list[Any]]]

IDLE_STATUS: dict[str, Any] = {"phase": "idle", "phase_since": None, "step": None, "steps_done": 0}


class TracerLike(Protocol):
    def status(self) -> dict[str, Any]: ...
    def poll(self) -> None: ...


class BatchBuilder:
    def __init__(
        self,
        recorder: Recorder,
        tracer: TracerLike | None,
        *,
        is_node_leader: Callable[[], bool],
        counters: Callable[[], dict[str, int]],
        reporter: ErrorReporter,
        sample_gpus: bool = True,
    ) -> None:
        self._recorder = recorder
        self._tracer = tracer
        self._is_leader = is_node_leader
        self._counters = counters
        self._reporter = reporter
        # NVML init can take 100+ ms on a GPU host: this constructor runs on
        # the sender thread, never inside agent.init().
        self._nvml = Nvml() if sample_gpus else None
        self._process = ProcessSampler(self._nvml)
        self._system = SystemSampler()
        self._gpus = GpuSampler(self._nvml) if self._nvml is not None else None

    def build(self, now: float, *, final: bool) -> Tables:
        rec = self._recorder
        status = dict(IDLE_STATUS)
        if self._tracer is not None:
            try:
                self._tracer.poll()
            except Exception as exc:
                self._reporter.report("tracer-poll", f"step capture error (steps may be missing): {exc!r}")
            try:
                status.update(self._tracer.status())
            except Exception as exc:
                self._reporter.report("tracer-status", f"could not read step status: {exc!r}")
        rec.add("status", {**status, "ts": now, "finished": 1 if final else 0})
        self._sample(now)
        for source, count in self._counters().items():
            rec.add("drops", {"ts": now, "source": source, "count": count})
        return rec.drain()

    def _sample(self, now: float) -> None:
        rec = self._recorder
        try:
            rec.add("process", self._process.sample(now))
            if self._is_leader():
                rec.add("system", self._system.sample(now))
                for row in self._gpus.sample(now) if self._gpus is not None else []:
                    rec.add("gpu", row)
        except Exception as exc:  # psutil on an exotic platform: lose samples, not steps
            self._reporter.report("sampler", f"resource sampling failed: {exc!r}")

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.close()


def wall_ts() -> float:
    return time.time()
