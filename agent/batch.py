"""What one flush puts in a batch: the tracer's rows plus the sampled state.

Runs on the sender thread. Order matters: ``tracer.poll()`` first (it resolves
finished CUDA events and lazy scalars into recorder rows), then one drain of the
recorder so a batch is a consistent cut, then the flush's own status, process,
host/GPU and drop-counter rows, which stay outside the recorder's cap.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Protocol

from agent.errors import ErrorReporter
from agent.recorder import Recorder
from agent.samplers import GpuSampler, Nvml, ProcessSampler, SystemSampler
from traceml_wire.tables import TableBuilder

Tables = dict[str, dict[str, list[Any]]]

IDLE_STATUS: dict[str, Any] = {"phase": "idle", "phase_since": None, "step": None, "steps_done": 0}

# The loss counters (cumulative, nearly always zero) go out when one changed, after a
# reconnect, at the end, and otherwise once every this many flushes, which covers a
# batch lost on the way without storing the same rows every second.
COUNTERS_REFRESH_FLUSHES = 60


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
        output: Callable[[], dict[str, list[Any]] | None] | None = None,
        extra: Callable[[], Tables] | None = None,
    ) -> None:
        self._recorder = recorder
        self._tracer = tracer
        self._is_leader = is_node_leader
        self._counters = counters
        self._reporter = reporter
        self._output = output  # the captured stdout/stderr lines (agent/output_capture.py)
        self._extra = extra  # spans, rollout sessions, profiles: columnar tables of their own buffers
        # NVML init can take 100+ ms on a GPU host: this constructor runs on
        # the sender thread, never inside agent.init().
        self._nvml = Nvml() if sample_gpus else None
        self._process = ProcessSampler(self._nvml)
        self._system = SystemSampler()
        self._gpus = GpuSampler(self._nvml) if self._nvml is not None else None
        self._poll_takes_final = _accepts(getattr(tracer, "poll", None), "final")
        self._resend_models = False
        self._sent_counters: dict[str, int] | None = None  # None: send the set next flush
        self._flushes_since_counters = 0

    def set_tracer(self, tracer: TracerLike) -> None:
        """The runtime builds its tracer lazily, possibly after this builder: attach it."""
        if tracer is self._tracer:
            return
        self._poll_takes_final = _accepts(getattr(tracer, "poll", None), "final")
        self._tracer = tracer

    def resend_models(self) -> None:
        """After a reconnect: the next batch repeats the "models" rows and the loss
        counters, in case the batch that first carried them was dropped from the
        resend buffer."""
        self._resend_models = True
        self._sent_counters = None

    @property
    def resolves_device(self) -> bool:
        """True while the tracer times steps with device events (the sender then calls
        ``resolve()`` between flushes, so the event pool refills)."""
        return bool(getattr(self._tracer, "has_device_events", False))

    def resolve(self) -> None:
        """Resolve the device events that completed since the last call (sender thread)."""
        resolve = getattr(self._tracer, "resolve_device", None)
        if resolve is None:
            return
        try:
            resolve()
        except Exception as exc:
            self._reporter.report("tracer-poll", f"step capture error (steps may be missing): {exc!r}")

    def build(self, now: float, *, final: bool) -> Tables:
        status = dict(IDLE_STATUS)
        if self._tracer is not None:
            try:
                if final and self._poll_takes_final:
                    self._tracer.poll(final=True)  # stop waiting on the device at exit
                else:
                    self._tracer.poll()
            except Exception as exc:
                self._reporter.report("tracer-poll", f"step capture error (steps may be missing): {exc!r}")
            try:
                status.update(self._tracer.status())
            except Exception as exc:
                self._reporter.report("tracer-status", f"could not read step status: {exc!r}")
        tables = self._recorder.drain()
        if self._output is not None:
            try:
                lines = self._output()
            except Exception as exc:
                self._reporter.report("output-capture", f"could not take captured output: {exc!r}")
                lines = None
            if lines:
                tables["output"] = lines
        if self._extra is not None:
            try:
                _merge(tables, self._extra())
            except Exception as exc:
                self._reporter.report("extra-tables", f"could not take spans or sessions: {exc!r}")
        # The flush's own rows bypass the recorder: a recorder full of steps must not
        # drop the final status or the very counters that report its drops.
        own: dict[str, list[dict[str, Any]]] = {"status": [{**status, "ts": now, "finished": 1 if final else 0}]}
        self._sample(now, own)
        if self._resend_models:
            self._resend_models = False
            own["models"] = list(self._optional("model_rows", list))
        counters = {**self._counters(), **self._optional("counters", dict)}
        self._flushes_since_counters += 1
        if (final or counters != self._sent_counters
                or self._flushes_since_counters >= COUNTERS_REFRESH_FLUSHES):
            self._sent_counters = counters
            self._flushes_since_counters = 0
            own["drops"] = [{"ts": now, "source": source, "count": count} for source, count in counters.items()]
        for name, rows in own.items():
            _append_rows(tables, name, rows)
        return tables

    def _optional(self, name: str, kind: type) -> Any:
        """A tracer extra beyond the fixed interface (model_rows, counters), if present."""
        method = getattr(self._tracer, name, None)
        if method is None:
            return kind()
        try:
            return method() or kind()
        except Exception as exc:
            self._reporter.report(f"tracer-{name}", f"could not read tracer {name}: {exc!r}")
            return kind()

    def _sample(self, now: float, own: dict[str, list[dict[str, Any]]]) -> None:
        try:
            own["process"] = [self._process.sample(now)]
            if self._is_leader():
                own["system"] = [self._system.sample(now)]
                own["gpu"] = self._gpus.sample(now) if self._gpus is not None else []
        except Exception as exc:  # psutil on an exotic platform: lose samples, not steps
            self._reporter.report("sampler", f"resource sampling failed: {exc!r}")

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.close()


def _accepts(method: Any, keyword: str) -> bool:
    try:
        return method is not None and keyword in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


def _append_rows(tables: Tables, name: str, rows: list[dict[str, Any]]) -> None:
    """Add row dicts to the columnar table ``name`` of a drained batch."""
    if not rows:
        return
    builder = TableBuilder(name)
    for row in rows:
        builder.append(row)
    cols = builder.take()
    if name not in tables:
        tables[name] = cols
        return
    for col, values in cols.items():
        tables[name][col].extend(values)


def _merge(tables: Tables, more: Tables) -> None:
    """Add the columnar tables ``more`` to a drained batch (same columns per table)."""
    for name, cols in more.items():
        have = tables.get(name)
        if have is None:
            tables[name] = cols
            continue
        for col, values in cols.items():
            have.setdefault(col, [None] * (len(next(iter(have.values()))) if have else 0)).extend(values)
