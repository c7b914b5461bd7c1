"""Step enter/exit's out-of-line branches, on the training thread.

``Tracer`` inherits these methods; its slots hold the state (``agent.tracer``).
The step context (``agent.tracer._StepContext``) enters them behind one test:
another loader's fetch or an H2D copy between steps, device events, a deep
dive, a user exception, a full device queue. Cold bytecode is what a step
pays for most, so the common CPU step runs none of this.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from agent import profiler as _profiler
from agent.capture.deep_dive import DeepDive
from agent.capture.events import EventBackend
from agent.capture.guard import ErrorGate
from agent.capture.model import ModelState
from agent.capture.record import StepRecord
from agent.device_sampling import DeviceSampler

_perf = time.perf_counter_ns


class RareBranchesMixin:
    """What a step does besides its common path: see ``_StepContext``."""

    __slots__ = ()
    # Slots of Tracer that these methods use.
    _rare: bool
    _fetches: dict[int, tuple[int, int]]
    _fed_by: int | None
    _h2d_out: int
    _h2d_out_dev: list[tuple[int, Any, Any]]
    _backend: EventBackend | None
    _sampler: DeviceSampler
    _deep_every: int
    _pending: deque[StepRecord]
    _max_pending: int
    _steps_done: int
    _gate: ErrorGate
    device_steps_overflow: int
    # _events, _host_row and _emit are StepRowsMixin's.

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
        prof = _profiler.active
        if prof is not None and prof.armed:
            prof.at_step(state.steps)  # starts or stops torch.profiler at this step boundary
            self._rare = self._rare or prof.armed

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
        sampled = self._sampler.next_is_sampled()
        rec.init_device(sampled)
        if not sampled:  # a host-only step makes no device call (agent/device_sampling.py)
            for _, ev0, ev1 in self._h2d_out_dev:
                backend.release(ev0)
                backend.release(ev1)
            self._h2d_out_dev = []
            return
        rec.dev = self._h2d_out_dev
        self._h2d_out_dev = []
        t0 = _perf()
        backend.reset_peak()
        rec.ev_enter = backend.mark()
        rec.dev_cost = _perf() - t0
        if rec.ev_enter is None:
            rec.dev_lost = True

    def _exit_device(self, rec: StepRecord) -> None:
        if not rec.sampled:
            return
        backend = self._backend
        assert backend is not None
        t0 = _perf()
        rec.ev_exit = backend.mark()
        t1 = _perf()
        rec.peak_bytes, rec.reserved_bytes = backend.memory()
        # The step's device calls: enter and exit measured, each phase's pair at the exit mark's cost.
        cost = rec.dev_cost + _perf() - t0 + 2 * len(rec.dev or ()) * (t1 - t0)
        self._sampler.observe(cost, rec.t_exit - rec.t_enter)
        if rec.ev_exit is None:
            rec.dev_lost = True

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
