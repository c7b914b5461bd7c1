"""The in-process step tracer: what runs on the training thread every step.

``trace_step(model)`` opens a ``StepRecord``; global patches (DataLoader
``__next__``, ``torch.autograd.backward``, optimizer step hooks, ``Tensor.to``
on CUDA) and a wrapper of the traced model's call fill it. At step exit the
record is only queued: the sender thread turns it into a ``steps`` row
(``agent.step_rows``), so building rows costs the training thread nothing.

The ``Tracer`` is split by job into mixins that share its slots: this module
keeps the per-step path (the step context, ``log``, ``span``, the H2D and DDP
callbacks); ``agent.tracer_rare`` the step's out-of-line branches;
``agent.step_rows`` the sender thread's side (rows, ``status``, ``poll``,
counters); ``agent.tracer_models`` install, model registration and the
backend choice.

Hot-path budget: a real step runs these hooks with cold caches (its own torch
work evicts them), where every bytecode, call and touched object costs far
more than in a hot loop (figures: docs/performance.md). So the hooks do their
work inline, no status object is published per phase change (``status()``
derives it), a record is created without an ``__init__`` frame, every
uncommon branch of step enter/exit sits out of line behind one flag
(``_rare``), the hot fields are slots, and no per-step work depends on the
module count.

Thread model: the training thread owns every ``StepRecord`` while it runs; the
sender thread only touches records handed over through a deque (append and
popleft are atomic under the GIL) and derives the phase from the active
record, so neither needs a lock.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from agent.capture.events import EventBackend, default_backend
from agent.capture.guard import ErrorGate
from agent.capture.model import ModelInfo, ModelState
from agent.capture.record import COMM, H2D, StepRecord
from agent.device_sampling import DeviceSampler, DeviceSamplingPolicy
from agent.recorder import Recorder
from agent.step_rows import _H2D_OUT, StepRowsMixin
from agent.tracer_models import ModelsMixin
from agent.tracer_rare import RareBranchesMixin

_AUTO: Any = object()
# The tracer's one clock, a module global: step enter/exit read it with a specialized
# LOAD_GLOBAL, where a clock held in a slot (``self._perf()``) is a generic method load
# (3.11 does not specialize slot callables).
_perf = time.perf_counter_ns
# Finished steps waiting for poll(): bounded so a sender thread that never polls cannot
# grow memory. Overflow: on CPU the oldest is dropped and counted (steps_dropped); on a
# device the oldest leaves at once with its host timings and is counted
# (device_steps_overflow).
MAX_PENDING_STEPS = 16384


class _NullContext:
    """Returned when tracing itself failed: the user's block still runs."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


_NULL = _NullContext()


class _StepContext(ModelState):
    """A model's state that is also its step context: one per model, reused every step.

    Nothing is allocated to open a step but the record, and the enter/exit
    logic lives here rather than in Tracer methods: one call level and one
    object less on the hottest path. Errors never escape (they are counted by
    the tracer's gate) and ``__exit__`` returns False, so the user's own
    exception always propagates unchanged.
    """

    __slots__ = ("_tracer",)

    def __init__(self, tracer: Tracer, model_id: int, model: torch.nn.Module | None, info: ModelInfo) -> None:
        super().__init__(model_id, model, info)
        self._tracer = tracer

    def __enter__(self) -> None:
        try:
            if self.current is not None:  # same model re-entered: the outer step owns it
                self.nest += 1
                return
            tracer = self._tracer
            # Every field the host path reads before writing (see StepRecord), set inline:
            # no __init__ frame on the training thread. (Recycling records through a pool
            # filled by poll() was tried: no gain in a real step, sometimes a loss.)
            rec = StepRecord()  # no __init__: C's object_new only
            rec.model_id = self.model_id
            rec.step = self.steps
            rec.ph_end = rec.t_enter = _perf()
            rec.dl_in = rec.h2d = rec.h2d_out = rec.fwd = rec.bwd = rec.opt = 0
            rec.fwd_depth = rec.bwd_depth = rec.opt_depth = rec.opt_t0 = rec.comm_wait = 0
            rec.comm = rec.deep = None
            fed_ns = tracer._fed_ns
            if fed_ns >= 0:  # the loader that fed the last step fetched again: the common case
                rec.dl_out = fed_ns
                rec.has_dl = True
                tracer._fed_ns = -1
            else:
                rec.dl_out = 0
                rec.has_dl = tracer._any_fetch  # a loader is in use: this step waited 0 for it
            # Everything else (other loaders' fetches, H2D before the step, device events, a deep
            # dive) is behind one flag: cold bytecode is what a step pays for most.
            if tracer._rare or self.leaves is not None:
                tracer._enter_rare(rec, self, fed_ns >= 0)
            rec.prev = tracer._active
            tracer._active = rec
            self.current = rec
        except Exception as exc:
            self._tracer._gate.fail("step_enter", exc)

    def __exit__(self, exc_type: object, exc: object, tb: object) -> bool:
        try:
            rec = self.current
            if rec is None or self.nest:
                if self.nest:
                    self.nest -= 1
                return False
            tracer = self._tracer
            self.current = None
            rec.t_exit = _perf()
            tracer._active = rec.prev
            rec.prev = None  # queued records must not keep a chain of older ones alive
            tracer._last = rec  # status() and rows outside a step read the last step from it
            if exc_type is not None or rec.deep is not None or tracer._backend is not None:
                tracer._exit_rare(rec, self, exc_type is not None)
                return False
            # On CPU the deque's maxlen drops the oldest record when nothing polled for
            # MAX_PENDING_STEPS steps; counted from the totals (Tracer.steps_dropped).
            # Append before counting, so a concurrent count never sees a phantom drop.
            tracer._pending.append(rec)
            self.steps += 1
            tracer._steps_done += 1
        except Exception as err:
            self._tracer._gate.fail("step_exit", err)
        return False  # never swallow the user's exception


class Tracer(StepRowsMixin, ModelsMixin, RareBranchesMixin):
    # trace_step() and span() return contexts that catch their own errors and return
    # False from __exit__: the runtime hands them to user code without a Guarded wrapper.
    FAIL_OPEN_CONTEXTS = True

    # Slots, hot ones first: fixed offsets instead of a large unshared __dict__, and the
    # fields a step touches share the object's first cache lines (a step runs cold).
    __slots__ = (
        "_active", "_fed_ns", "_any_fetch", "_rare", "_pending", "_last", "_steps_done",
        "_dl_t0", "_fed_by", "_models", "_backend", "_fetches", "_fetch_seq", "_h2d_t0",
        "_h2d_out", "_h2d_out_dev", "_recorder", "_gate", "_deep_dive", "_deep_every", "_timeout_ns",
        "_cuda", "_wall_offset_ns", "_created", "_none_state", "_next_model_id", "_emitted",
        "_dropped_seen", "_scalars", "_rss", "_undo", "_installed", "device_steps_dropped",
        "device_steps_fallback", "device_steps_overflow", "_max_pending", "_backend_undecided", "_fingerprints",
        "_sampler",
        "__weakref__",
    )

    def __init__(
        self,
        recorder: Recorder,
        *,
        deep_dive: bool = False,
        deep_dive_every: int = 50,
        warn: Callable[[str, str], None] = lambda kind, msg: None,
        event_backend: EventBackend | None = _AUTO,
        event_timeout_s: float = 30.0,
        max_pending_steps: int | None = None,
        fingerprint_every: int = 0,
        device_sampling: DeviceSamplingPolicy | None = None,
    ) -> None:
        backend: EventBackend | None = default_backend() if event_backend is _AUTO else event_backend
        # A backend picked automatically is confirmed at the first traced model: a CPU job
        # on a GPU machine keeps the host clock (see _decide_backend).
        self._backend_undecided = event_backend is _AUTO and backend is not None
        # The attributes every step reads or writes come first (see __slots__).
        self._active: StepRecord | None = None
        # DataLoader fetches since the last step entered: the fed loader's last wait
        # (-1: none), any other loader's by dataset id -> (seq, ns).
        self._fed_ns = -1
        self._any_fetch = False
        # Step enter takes its out-of-line branch (_enter_rare): set by another loader's fetch
        # or an H2D copy between steps, always on a device backend.
        self._rare = backend is not None
        # CPU records are final at exit, so the oldest may go when the queue is full; device
        # records hold pooled events: past the bound the training thread takes the oldest
        # out itself (_overflow_device), releasing its events and keeping its host timings.
        # None: the module's bound, read now (tests lower it by patching the module).
        self._max_pending = max(1, int(MAX_PENDING_STEPS if max_pending_steps is None else max_pending_steps))
        self._pending: deque[StepRecord] = deque(maxlen=self._max_pending) if backend is None else deque()
        # What status() reads besides the active record: the last step closed (its step
        # number, when the thread went idle), the start of a DataLoader fetch / H2D copy in progress.
        self._last: StepRecord | None = None
        self._steps_done = 0
        self._dl_t0 = 0
        self._fed_by: int | None = None
        self._models: dict[int, ModelState] = {}
        self._backend = backend
        # Which steps of a device backend carry device timing (the others are host-only).
        self._sampler = DeviceSampler(device_sampling)
        self._fetches: dict[int, tuple[int, int]] = {}
        self._fetch_seq = 0
        self._h2d_t0 = 0
        # H2D copies made outside any step: charged to the next step.
        self._h2d_out = 0
        self._h2d_out_dev: list[tuple[int, Any, Any]] = []
        self._recorder = recorder
        self._gate = ErrorGate(warn)
        self._deep_dive = deep_dive
        self._deep_every = max(1, int(deep_dive_every))
        self._timeout_ns = int(event_timeout_s * 1e9)
        try:
            self._cuda = bool(torch.cuda.is_available())
        except Exception:
            self._cuda = False
        # wall = perf + offset; status() converts without a clock call on the hot path.
        self._wall_offset_ns = time.time_ns() - time.perf_counter_ns()
        self._created = _perf()
        self._none_state: ModelState | None = None
        self._next_model_id = 0
        self._emitted = 0  # records poll() turned into rows
        self._dropped_seen = 0
        from agent.capture.scalars import LazyScalars

        self._scalars = LazyScalars()
        self._rss: int | None = None
        self._undo: list[Callable[[], None]] = []
        self._installed = False
        self.device_steps_dropped = 0  # steps whose events timed out: host timings used
        self.device_steps_fallback = 0  # steps that lost an event (pool exhausted): host timings used
        self.device_steps_overflow = 0  # steps over the pending bound before poll() came: host timings used
        # Numerics fingerprints every N steps (agent.fingerprint); None when off: models then get
        # the plain step context and a step runs nothing for them.
        self._fingerprints: Any = None
        if fingerprint_every > 0:
            from agent.fingerprint import Fingerprints

            self._fingerprints = Fingerprints(fingerprint_every, self._gate)

    # --------------------------------------------------------------- public API

    def trace_step(self, model: torch.nn.Module | None = None) -> Any:
        try:
            # Every step after the model's first: one dict lookup and one weakref call
            # (agent.trace_step inlines the same lookup on ``models``).
            state = self._models.get(id(model))
            if state is not None and state.ref() is model:
                return state
            return self._model_state(model)
        except Exception as exc:
            self._gate.fail("trace_step", exc)
            return _NULL

    def log(self, **scalars: float | torch.Tensor) -> None:
        try:
            rec = self._active
            step = rec.step if rec is not None else self._last_step
            for name, value in scalars.items():
                try:
                    if isinstance(value, torch.Tensor):
                        self._scalars.add(step, name, value, self._backend)
                    else:
                        self._emit("scalars", {"step": step, "name": name, "value": float(value)})
                except Exception as exc:
                    self._gate.fail("log", exc)
        except Exception as exc:
            self._gate.fail("log", exc)

    @contextmanager
    def _span_cm(self, name: str, args: dict[str, Any]) -> Iterator[None]:
        start_wall = time.time_ns()
        t0 = _perf()
        try:
            yield
        finally:
            try:
                self._emit_span(name, start_wall, _perf() - t0, args)
            except Exception as exc:
                self._gate.fail("span", exc)

    def span(self, name: str, **args: Any) -> Any:
        try:
            return self._span_cm(str(name), args)
        except Exception as exc:
            self._gate.fail("span", exc)
            return _NULL

    def instant(self, name: str, **args: Any) -> None:
        try:
            self._emit_span(str(name), time.time_ns(), None, args)
        except Exception as exc:
            self._gate.fail("instant", exc)

    # --------------------------------------------------------- phase callbacks
    # Forward, backward, optimizer and DataLoader timing are inlined in the
    # capture modules' hooks (agent.capture.*); what stays here is device-only
    # or per-bucket work, where a method call is not the cost that matters.

    def _h2d_begin(self) -> tuple[int, Any]:
        try:
            t = _perf()
            ev = self._backend.mark() if self._backend is not None and self._device_next() else None
            self._h2d_t0 = t
            return (t, ev)
        except Exception as exc:
            self._gate.fail("h2d", exc)
            return (0, None)

    def _h2d_end(self, token: tuple[int, Any]) -> None:
        try:
            t0, ev0 = token
            if not t0:
                return
            self._h2d_t0 = 0
            t = _perf()
            rec = self._active
            if rec is not None:
                rec.h2d += t - t0
                rec.ph_end = t
                if self._backend is not None:
                    self._dev_pair(rec, H2D, ev0)  # releases ev0 on a host-only step
            elif self._last is None:
                # Before the first step: set-up (model.cuda(), buffers), not any step's
                # input. Charged to step 0, moving a large model would read as seconds of H2D.
                if ev0 is not None and self._backend is not None:
                    self._backend.release(ev0)
            else:
                self._h2d_out += t - t0
                self._rare = True  # the next step's enter charges it
                if self._backend is not None and ev0 is not None:
                    ev1 = self._backend.mark()
                    if ev1 is not None:
                        self._h2d_out_dev.append((_H2D_OUT, ev0, ev1))
                    else:
                        self._backend.release(ev0)
        except Exception as exc:
            self._gate.fail("h2d", exc)

    def _comm_begin(self) -> tuple[int, Any]:
        try:
            return (_perf(), self._backend.mark() if self._backend is not None and self._device_next() else None)
        except Exception as exc:
            self._gate.fail("ddp_comm", exc)
            return (0, None)

    def _comm_wait(self, rec: StepRecord) -> None:
        """The last DDP bucket was launched: backward compute is done, the rest is waiting."""
        try:
            rec.comm_wait = _perf()  # set from the autograd thread; status() compares it
        except Exception as exc:
            self._gate.fail("ddp_comm", exc)

    def _comm_end(self, rec: StepRecord, start: tuple[int, Any]) -> None:
        # Called on the collective's completion thread; list.append is atomic.
        try:
            t0, ev0 = start
            if not t0:
                return
            t = _perf()
            if rec.comm is None:
                rec.comm = []
            rec.comm.append((t0, t))
            if self._backend is not None:
                self._dev_pair(rec, COMM, ev0)
        except Exception as exc:
            self._gate.fail("ddp_comm", exc)

    def _device_next(self) -> bool:
        """Whether the step in progress (or, between steps, the next one) carries device timing."""
        rec = self._active
        return rec.sampled if rec is not None else self._sampler.next_will_be_sampled

    def _dev_pair(self, rec: StepRecord, slot: int, ev0: Any) -> None:
        backend = self._backend
        assert backend is not None
        if not rec.sampled:  # a host-only step: an event taken before it was known goes back
            if ev0 is not None:
                backend.release(ev0)
            return
        ev1 = backend.mark()
        if ev0 is None or ev1 is None:
            rec.dev_lost = True
            for ev in (ev0, ev1):
                if ev is not None:
                    backend.release(ev)
            return
        if rec.dev is None:
            rec.dev = []
        rec.dev.append((slot, ev0, ev1))
