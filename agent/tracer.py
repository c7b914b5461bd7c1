"""The in-process step tracer: everything that runs on the training thread.

``trace_step(model)`` opens a ``StepRecord``; global patches (DataLoader
``__next__``, ``torch.autograd.backward``, optimizer step hooks, ``Tensor.to``
on CUDA) and a wrapper of the traced model's call fill it. At step exit the
record is only queued: ``poll()`` (sender thread, about once a second) turns
it into a ``steps`` row, at once on CPU, on GPU once its device events
completed. Building the row (a 14-key dict, the wait arithmetic, the
recorder's byte accounting) thus costs the training thread nothing.

Hot-path budget: the training thread pays, per step, the context's enter and
exit, the model's call wrapper (``capture.model.TimedCall``; forward hooks only
where ordering needs them), the backward wrapper, two optimizer hooks and the
DataLoader patch. Inside a real step all of that runs with cold caches (the
step's own torch work evicts it), where every bytecode, call and touched
object costs several times its hot-loop price (figures: docs/performance.md).
So the hooks do their work
inline (no call into a Tracer method on CPU), no status object is published
per phase change (``status()`` derives it), a record is created without an
``__init__`` frame, every uncommon branch of step enter/exit sits out of line
behind one flag (``_rare``), the Tracer's hot fields are slots, and nothing
walks or hooks the submodules: no per-step work depends on the module count.

Thread model: the training thread owns every ``StepRecord`` while it runs;
``poll()`` only touches records already handed over through a deque (append
and popleft are atomic under the GIL), and ``status()`` derives the phase from
the active record's depths and times (see its docstring), so neither needs a
lock.
"""

from __future__ import annotations

import json
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from agent.capture import autograd, dataloader, ddp, h2d, optimizer
from agent.capture.deep_dive import DeepDive
from agent.capture.events import EventBackend, default_backend
from agent.capture.guard import ErrorGate
from agent.capture.memory import read_rss
from agent.capture.model import ModelInfo, ModelState, describe, leaf_modules, time_forward
from agent.capture.record import (
    BACKWARD,
    COMM,
    FORWARD,
    H2D,
    IDLE,
    OPTIMIZER,
    PH_BACKWARD,
    PH_DATALOADER,
    PH_FORWARD,
    PH_H2D,
    PH_OPTIMIZER,
    PH_WAIT,
    StepRecord,
    derive_wait,
)
from agent.recorder import Recorder

_AUTO: Any = object()
# The tracer's one clock, a module global: step enter/exit read it with a specialized
# LOAD_GLOBAL, where a clock held in a slot (``self._perf()``) is a generic method load
# (3.11 does not specialize slot callables).
_perf = time.perf_counter_ns
# Device triple slot for copies made before the step entered (outside its event window).
_H2D_OUT = 6
# Finished steps waiting for poll(): bounded (a record is a few hundred bytes) so a sender
# thread that never polls cannot grow memory. Overflow: on CPU the oldest is dropped and
# counted (steps_dropped); on a device the oldest leaves at once with its host timings
# and is counted (device_steps_overflow).
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


class Tracer:
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
        "device_steps_fallback", "device_steps_overflow", "_max_pending", "_backend_undecided", "__weakref__",
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

    # ------------------------------------------------------------------ install

    def install(self) -> None:
        try:
            if self._installed:
                return
            self._installed = True
            self._undo.append(dataloader.install(self))
            self._undo.append(autograd.install(self))
            self._undo.append(optimizer.install(self))
            if self._cuda:
                self._undo.append(h2d.install(self))
        except Exception as exc:
            self._gate.fail("install", exc)

    def _remove_patches(self) -> None:
        """Undo the global patches install() made, newest first."""
        while self._undo:
            undo = self._undo.pop()
            try:
                undo()
            except Exception as exc:
                self._gate.fail("uninstall", exc)
        self._installed = False

    def uninstall(self) -> None:
        try:
            self._remove_patches()
            for state in list(self._models.values()):
                state.remove_hooks()
            self._models.clear()
            self._active = None
        except Exception as exc:
            self._gate.fail("uninstall", exc)

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

    def status(self) -> dict[str, Any]:
        """The training thread's phase now, derived from what the hooks already store.

        Runs on the sender thread, about once a second. Hooks write a phase's
        start before raising its depth and its end before lowering it, so a
        read racing them reports the neighbouring phase for that instant at
        worst, and the next read is right: cheaper for the training thread
        than publishing a status object at every phase change.
        """
        try:
            phase, since, step = self._phase()
            return {
                "phase": phase,
                "phase_since": (since + self._wall_offset_ns) / 1e9,
                "step": step,
                "steps_done": self._steps_done,
            }
        except Exception as exc:
            self._gate.fail("status", exc)
            return {"phase": IDLE, "phase_since": time.time(), "step": None, "steps_done": 0}

    @property
    def _last_step(self) -> int | None:
        last = self._last
        return last.step if last is not None else None

    def _phase(self) -> tuple[str, int, int | None]:
        rec = self._active
        step = rec.step if rec is not None else self._last_step
        t = self._dl_t0
        if t:
            return PH_DATALOADER, t, step
        t = self._h2d_t0
        if t:
            return PH_H2D, t, step
        if rec is None:
            last = self._last
            return IDLE, last.t_exit if last is not None else self._created, step
        if rec.bwd_depth > 0:
            start = rec.bwd_end  # the start while backward runs
            wait = rec.comm_wait
            # DDP launched this backward's last bucket: compute is over, the rank waits.
            if wait > start:
                return PH_WAIT, wait, step
            return PH_BACKWARD, start, step
        if rec.opt_depth > 0:
            return PH_OPTIMIZER, rec.opt_t0, step
        if rec.fwd_depth > 0:
            return PH_FORWARD, rec.fwd_t0, step
        return PH_WAIT, rec.ph_end, step

    def poll(self, final: bool = False) -> None:
        """Resolve device events and lazy scalars; ``final`` (shutdown) stops waiting on the device."""
        try:
            self._rss = read_rss()
        except Exception as exc:
            self._gate.fail("rss", exc)
        try:
            self._resolve_pending(final)
        except Exception as exc:
            self._gate.fail("poll_steps", exc)
        try:
            for row in self._scalars.resolve(self._backend, self._timeout_ns, final):
                self._emit("scalars", row)
        except Exception as exc:
            self._gate.fail("poll_scalars", exc)

    @property
    def has_device_events(self) -> bool:
        """Steps are timed with device events, which ``resolve_device`` hands back to their pool."""
        return self._backend is not None

    def resolve_device(self) -> None:
        """Between flushes (sender thread): emit the steps whose device events completed,
        returning the events to the pool; the host path has nothing to resolve."""
        if self._backend is None:
            return
        try:
            self._resolve_pending(False)
        except Exception as exc:
            self._gate.fail("poll_steps", exc)

    def parallelism(self) -> str:
        try:
            kinds = {state.info.parallelism for state in self._states()}
            for kind in ("fsdp2", "ddp"):
                if kind in kinds:
                    return kind
        except Exception as exc:
            self._gate.fail("parallelism", exc)
        return "single"

    # Extras for the runtime (not part of the fixed interface).

    @property
    def models(self) -> dict[int, Any]:
        """id(model) -> its step context (``.ref()`` is the model: ids are reused after a
        model dies); ``None`` is registered too. The runtime's fast path reads it."""
        return self._models

    def _states(self) -> list[ModelState]:
        states = {id(s): s for s in list(self._models.values())}
        if self._none_state is not None:
            states[id(self._none_state)] = self._none_state
        return sorted(states.values(), key=lambda s: s.model_id)

    def model_rows(self) -> list[dict[str, Any]]:
        """One "models" row per traced model (to resend after a reconnect)."""
        return [s.info.row(s.model_id) for s in self._states()]

    def counters(self) -> dict[str, int]:
        """Cumulative loss/failure counters, for the "drops" table."""
        out = {
            "tracer_errors": self._gate.total(),
            "device_steps_dropped": self.device_steps_dropped,
            "device_steps_fallback": self.device_steps_fallback,
            "device_steps_overflow": self.device_steps_overflow,
            "steps_dropped": self.steps_dropped,
            "scalars_dropped": self._scalars.dropped,
        }
        if self._backend is not None:
            out["events_exhausted"] = int(getattr(self._backend, "exhausted", 0))
        return out

    # ------------------------------------------------------------------ models

    def _model_state(self, model: torch.nn.Module | None) -> ModelState:
        if model is None:
            if self._none_state is None:
                self._none_state = self._new_state(None)
            # Its ref() returns None, so the one lookup in trace_step finds it too.
            self._models[id(None)] = self._none_state
            return self._none_state
        state = self._models.get(id(model))
        if state is not None and state.ref() is model:
            return state
        if state is not None:  # id reused by a new object after the old model died
            state.remove_hooks()
        state = self._new_state(model)
        self._models[id(model)] = state
        return state

    def _new_state(self, model: torch.nn.Module | None) -> ModelState:
        if not self._installed:
            self.install()
        if self._backend_undecided:
            self._decide_backend()
        info = describe(model)
        state = _StepContext(self, self._next_model_id, model, info)
        self._next_model_id += 1
        if model is not None:
            state.handles = time_forward(model, info, self)
            if info.parallelism == "ddp":
                try:
                    state.comm_hooked = ddp.attach(model, self)
                except Exception as exc:
                    self._gate.fail("ddp_comm_hook", exc)
            if self._deep_dive and info.parallelism != "fsdp2":
                state.leaves = leaf_modules(model)
            key = id(model)

            def forget(_: object, key: int = key, state: ModelState = state) -> None:
                if self._models.get(key) is state:
                    del self._models[key]

            state.ref = weakref.ref(model, forget)
        self._emit("models", info.row(state.model_id))
        return state

    # ------------------------------------------- step enter/exit: the rarer branches

    def _decide_backend(self) -> None:
        """Keep the automatic CUDA backend only if this process uses CUDA.

        Decided once, when the first model is traced (its parameters are where they
        will train by then). A CPU job on a GPU machine would otherwise record CUDA
        events on an idle device every step and make each rank create a CUDA context
        (hundreds of MB of GPU memory, a second or more) for nothing.
        """
        self._backend_undecided = False
        try:
            in_use = bool(torch.cuda.is_initialized())
        except Exception:
            in_use = False
        if in_use or self._steps_done or self._pending:
            return
        self._backend = None
        self._pending = deque(maxlen=self._max_pending)  # empty: the CPU queue drops the oldest
        # The global patches hold the backend they were installed with: install them again.
        if self._installed:
            self._remove_patches()
            self.install()

    def _enter_rare(self, rec: StepRecord, state: ModelState, fed: bool) -> None:
        """Step enter's out-of-line branch (see _StepContext.__enter__)."""
        fetches = self._fetches
        if fetches:
            if fed:
                fetches.clear()  # the fed loader fetched: other loaders (validation) ran in between
            else:
                self._take_fetch(rec)
        if self._h2d_out:
            rec.h2d_out = self._h2d_out
            self._h2d_out = 0
        if self._backend is not None:
            self._enter_device(rec)
        if state.leaves is not None and state.steps % self._deep_every == 0:
            self._start_deep(rec, state)
        self._rare = self._backend is not None

    def _take_fetch(self, rec: StepRecord) -> None:
        """No fetch from the loader that fed the last step, but others: the latest feeds this one.

        The first step, or training moved to another loader (a new dataset).
        """
        fetches = self._fetches
        key = max(fetches, key=lambda k: fetches[k][0])
        rec.dl_out = fetches[key][1]
        rec.has_dl = True
        self._fed_by = key
        fetches.clear()

    def _enter_device(self, rec: StepRecord) -> None:
        backend = self._backend
        assert backend is not None
        rec.init_device()
        rec.dev = self._h2d_out_dev
        self._h2d_out_dev = []
        backend.reset_peak()
        rec.ev_enter = backend.mark()
        if rec.ev_enter is None:
            rec.dev_lost = True

    def _exit_device(self, rec: StepRecord) -> None:
        backend = self._backend
        assert backend is not None
        rec.ev_exit = backend.mark()
        if rec.ev_exit is None:
            rec.dev_lost = True
        rec.peak_bytes, rec.reserved_bytes = backend.memory()

    def _start_deep(self, rec: StepRecord, state: ModelState) -> None:
        try:
            rec.deep = DeepDive(state.leaves or [], self._gate)
        except Exception as exc:
            self._gate.fail("deep_dive", exc)

    def _exit_rare(self, rec: StepRecord, state: ModelState, failed: bool) -> None:
        """Step exit with device events, a deep dive to close or a user exception: off the common path."""
        backend = self._backend
        if backend is not None:
            self._exit_device(rec)
        deep = rec.deep
        if deep is not None:
            rec.deep = None
            deep.detach()
        if failed:  # the user's step raised: no row and no step number used
            if backend is not None:
                for ev in self._events(rec):
                    backend.release(ev)
            return
        if backend is not None and len(self._pending) >= self._max_pending:
            self._overflow_device(backend)
        self._pending.append(rec)
        state.steps += 1
        self._steps_done += 1
        if deep is not None:
            for row in deep.rows(rec.step, getattr(rec, "bwd_end", 0) or rec.t_exit):
                self._emit("layers", row)

    def _overflow_device(self, backend: EventBackend) -> None:
        """The device queue is full (poll() fell behind, or the sender thread is stuck):
        the oldest step leaves now, as a timed-out one would, with its host timings.

        Runs on the training thread, only past the bound. Its events go back to the pool
        (a dropped record would keep them out of it for good). poll() pops a record before
        judging it and puts it back at the head if it is not done, so the two threads never
        take the same record; the queue holds at most one over the bound meanwhile.
        """
        try:
            rec = self._pending.popleft()
        except IndexError:
            return  # poll() emptied it meanwhile
        for ev in self._events(rec):
            backend.release(ev)
        self.device_steps_overflow += 1
        self._emit("steps", self._host_row(rec))

    @property
    def steps_dropped(self) -> int:
        """CPU steps dropped because nothing polled for MAX_PENDING_STEPS steps (cumulative).

        Derived (appended - emitted - queued) instead of counted at the drop, which the
        deque's maxlen does silently: the training thread pays no length check per step.
        The training thread appends before counting and poll() pops before counting, so a
        racing read can only come out low; keeping the maximum makes it monotonic.
        """
        if self._backend is not None:
            return 0
        done = self._steps_done
        emitted = self._emitted
        self._dropped_seen = max(self._dropped_seen, done - emitted - len(self._pending))
        return self._dropped_seen

    # --------------------------------------------------------- phase callbacks
    # Forward, backward, optimizer and DataLoader timing are inlined in the
    # capture modules' hooks (agent.capture.*); what stays here is device-only
    # or per-bucket work, where a method call is not the cost that matters.

    def _h2d_begin(self) -> tuple[int, Any]:
        try:
            t = _perf()
            ev = self._backend.mark() if self._backend is not None else None
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
                    self._dev_pair(rec, H2D, ev0)
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
            return (_perf(), self._backend.mark() if self._backend is not None else None)
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

    def _dev_pair(self, rec: StepRecord, slot: int, ev0: Any) -> None:
        backend = self._backend
        assert backend is not None
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

    # ------------------------------------------------------------------ rows

    def _host_row(self, rec: StepRecord) -> dict[str, Any]:
        step_ns = rec.t_exit - rec.t_enter + rec.dl_out + rec.h2d_out
        dl = rec.dl_out + rec.dl_in if rec.has_dl else None
        h2d_ns = rec.h2d + rec.h2d_out if self._cuda else None
        return self._row(rec, step_ns, dl, h2d_ns, rec.fwd, rec.bwd, rec.opt, rec.comm)

    def _row(self, rec: StepRecord, step_ns: int, dl: int | None, h2d_ns: int | None, fwd: int, bwd: int, opt: int,
             comm: list[tuple[int, int]] | None) -> dict[str, Any]:
        comm_ns, wait = derive_wait(comm)
        if wait is not None:
            # Backward ran until DDP's last all-reduce completed; the blocked part is wait.
            bwd = max(0, bwd - wait)
        else:
            wait = max(0, step_ns - (dl or 0) - (h2d_ns or 0) - fwd - bwd - opt)
        return {
            "step": rec.step,
            "ts": (rec.t_exit + self._wall_offset_ns) / 1e9,
            "step_ns": step_ns,
            "dataloader_ns": dl,
            "h2d_ns": h2d_ns,
            "forward_ns": fwd,
            "backward_ns": bwd,
            "optimizer_ns": opt,
            "wait_ns": wait,
            "comm_ns": comm_ns,
            # Set on the device path only (StepRecord.init_device).
            "peak_bytes": getattr(rec, "peak_bytes", None),
            "reserved_bytes": getattr(rec, "reserved_bytes", None),
            "rss_bytes": self._rss,
            "model_id": rec.model_id,
        }

    @staticmethod
    def _events(rec: StepRecord) -> list[Any]:
        evs = [ev for ev in (rec.ev_enter, rec.ev_exit) if ev is not None]
        for _, ev0, ev1 in rec.dev or ():
            evs.append(ev0)
            evs.append(ev1)
        return evs

    def _resolve_pending(self, final: bool) -> None:
        backend = self._backend
        pending = self._pending
        if backend is None:
            # Host timings are final at exit. Pop before reading: the training thread's append
            # may drop the oldest record concurrently when the queue is full (deque ops are atomic).
            while True:
                try:
                    rec = pending.popleft()
                except IndexError:
                    return
                self._emitted += 1
                self._emit("steps", self._host_row(rec))
        now = _perf()
        while True:
            # Pop before judging: the training thread may take the oldest out concurrently
            # when the queue is full (_overflow_device); a record not done yet goes back.
            try:
                rec = pending.popleft()
            except IndexError:
                return
            events = self._events(rec)
            if rec.dev_lost:
                self.device_steps_fallback += 1
                row = self._host_row(rec)
            elif all(backend.done(ev) for ev in events):
                try:
                    row = self._device_row(rec, backend)
                except Exception:
                    pending.appendleft(rec)  # as before: it stays at the head (poll() counts the error)
                    raise
            elif final or now - rec.t_exit > self._timeout_ns:
                # Head of line stuck past the bound: keep the step with host timings, count the drop.
                self.device_steps_dropped += 1
                row = self._host_row(rec)
            else:
                pending.appendleft(rec)
                return  # in-order completion: later steps cannot be done before this one
            for ev in events:
                backend.release(ev)
            self._emit("steps", row)

    def _device_row(self, rec: StepRecord, backend: EventBackend) -> dict[str, Any]:
        acc = [0] * 7
        comm: list[tuple[int, int]] | None = None
        ev_enter = rec.ev_enter
        for slot, ev0, ev1 in rec.dev or ():
            if slot == COMM:
                if comm is None:
                    comm = []
                # Offsets from step start put all buckets on one timeline.
                comm.append((backend.elapsed_ns(ev_enter, ev0), backend.elapsed_ns(ev_enter, ev1)))
            acc[slot] += max(0, backend.elapsed_ns(ev0, ev1))
        step_ns = max(0, backend.elapsed_ns(ev_enter, rec.ev_exit)) + rec.dl_out + acc[_H2D_OUT]
        dl = rec.dl_out + rec.dl_in if rec.has_dl else None
        return self._row(rec, step_ns, dl, acc[H2D] + acc[_H2D_OUT], acc[FORWARD], acc[BACKWARD], acc[OPTIMIZER],
                         comm)

    def _emit(self, table: str, row: dict[str, Any]) -> None:
        # A failing recorder costs the row, never the step or the model's state.
        try:
            self._recorder.add(table, row)
        except Exception as exc:
            self._gate.fail("recorder", exc)

    def _emit_span(self, name: str, start_wall: int, dur: int | None, args: dict[str, Any]) -> None:
        rec = self._active
        self._emit(
            "spans",
            {
                "name": name,
                "start_ns": start_wall,
                "dur_ns": dur,
                "step": rec.step if rec is not None else self._last_step,
                "args": json.dumps(args, default=str) if args else "{}",
            },
        )
