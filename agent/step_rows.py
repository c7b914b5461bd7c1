"""The tracer's sender-thread side: finished step records become rows.

``Tracer`` inherits these methods; its slots hold the state (``agent.tracer``).
The training thread only queues a record at step exit; ``poll()`` and
``resolve_device()`` turn it into a ``steps`` row here, once its device
events completed on a GPU, so building a row costs the training thread
nothing. ``status()`` derives the training thread's phase from what the
hooks already store, so no status object is published per phase change.
"""

from __future__ import annotations

import json
import time
from collections import deque
from typing import Any

from agent.capture import fsdp2_comm
from agent.capture.events import EventBackend
from agent.capture.guard import ErrorGate
from agent.capture.memory import read_rss
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

_perf = time.perf_counter_ns
# Device triple slot for copies made before the step entered (outside its event window).
_H2D_OUT = 6
# What a host-only step of a device tracer leaves empty (agent/device_sampling.py).
_DEVICE_PHASE_COLUMNS = ("h2d_ns", "forward_ns", "backward_ns", "optimizer_ns", "wait_ns", "comm_ns",
                         "fwd_comm_ns", "bwd_comm_ns", "replicate_comm_ns")


class StepRowsMixin:
    """Rows, status and loss counters, read or built off the training thread."""

    __slots__ = ()
    # Slots of Tracer that these methods use.
    _active: StepRecord | None
    _last: StepRecord | None
    _pending: deque[StepRecord]
    _backend: EventBackend | None
    _recorder: Recorder
    _gate: ErrorGate
    _cuda: bool
    _rss: int | None
    _scalars: Any
    _fingerprints: Any  # agent.fingerprint.Fingerprints, None when off
    _wall_offset_ns: int
    _created: int
    _timeout_ns: int
    _steps_done: int
    _emitted: int
    _dropped_seen: int
    _dl_t0: int
    _h2d_t0: int
    device_steps_dropped: int
    device_steps_fallback: int
    device_steps_overflow: int

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
            # DDP launched this backward's last bucket: compute is over, the rank waits; or
            # the rank is blocked in an FSDP2 collective (until it returns).
            if wait > start:
                return PH_WAIT, wait, step
            return PH_BACKWARD, start, step
        if rec.opt_depth > 0:
            return PH_OPTIMIZER, rec.opt_t0, step
        if rec.fwd_depth > 0:
            wait = rec.comm_wait
            # Blocked in an FSDP2 all-gather for a peer (agent.capture.fsdp2_comm sets it).
            if wait > rec.fwd_t0:
                return PH_WAIT, wait, step
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
        fingerprints = self._fingerprints
        if fingerprints is not None:
            try:
                for row in fingerprints.resolve(self._backend, self._timeout_ns, final):
                    self._emit("fingerprints", row)
            except Exception as exc:
                self._gate.fail("poll_fingerprints", exc)

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
        if self._fingerprints is not None:
            out["fingerprints_dropped"] = self._fingerprints.dropped
        return out

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

    # ------------------------------------------------------------------ rows

    def _host_row(self, rec: StepRecord) -> dict[str, Any]:
        step_ns = rec.t_exit - rec.t_enter + rec.dl_out + rec.h2d_out
        dl = rec.dl_out + rec.dl_in if rec.has_dl else None
        h2d_ns = rec.h2d + rec.h2d_out if self._cuda else None
        # FSDP2 host sums are the wait on CPU only: on a device they time kernel launches.
        fsdp = fsdp2_comm.host_sums(rec) if self._backend is None else None
        row = self._row(rec, step_ns, dl, h2d_ns, rec.fwd, rec.bwd, rec.opt, rec.comm, fsdp)
        if self._backend is not None:
            row["device_timed"] = 0
        return row

    def _host_only_row(self, rec: StepRecord) -> dict[str, Any]:
        """A device tracer's step without device timing: its length and input wait as the host
        saw them; the device phases stay empty (host times there are launch times, not work)."""
        row = self._host_row(rec)
        for column in _DEVICE_PHASE_COLUMNS:
            row[column] = None
        row["device_timed"] = 0
        return row

    def _row(self, rec: StepRecord, step_ns: int, dl: int | None, h2d_ns: int | None, fwd: int, bwd: int, opt: int,
             comm: list[tuple[int, int]] | None, fsdp: list[int] | None = None) -> dict[str, Any]:
        comm_ns, wait = derive_wait(comm)
        if wait is not None:
            # Backward ran until DDP's last all-reduce completed; the blocked part is wait.
            bwd = max(0, bwd - wait)
        else:
            wait = max(0, step_ns - (dl or 0) - (h2d_ns or 0) - fwd - bwd - opt)
        row = {
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
            "post_forward_bytes": getattr(rec, "post_fwd", None),
            # 1: phases timed on the device; 0: a device tracer's step with host timings; None on CPU.
            "device_timed": None,
        }
        row.update(fsdp2_comm.row_fields(fsdp))
        return row

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
            if not rec.sampled:
                row = self._host_only_row(rec)
            elif rec.dev_lost:
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
        acc = [0] * (fsdp2_comm.DEVICE_SLOT0 + fsdp2_comm.N_SLOTS)
        fsdp_seen = False
        comm: list[tuple[int, int]] | None = None
        ev_enter = rec.ev_enter
        for slot, ev0, ev1 in rec.dev or ():
            if slot == COMM:
                if comm is None:
                    comm = []
                # Offsets from step start put all buckets on one timeline.
                comm.append((backend.elapsed_ns(ev_enter, ev0), backend.elapsed_ns(ev_enter, ev1)))
            elif slot >= fsdp2_comm.DEVICE_SLOT0:
                fsdp_seen = True
            acc[slot] += max(0, backend.elapsed_ns(ev0, ev1))
        fsdp = acc[fsdp2_comm.DEVICE_SLOT0:] if fsdp_seen else None
        step_ns = max(0, backend.elapsed_ns(ev_enter, rec.ev_exit)) + rec.dl_out + acc[_H2D_OUT]
        dl = rec.dl_out + rec.dl_in if rec.has_dl else None
        row = self._row(rec, step_ns, dl, acc[H2D] + acc[_H2D_OUT], acc[FORWARD], acc[BACKWARD], acc[OPTIMIZER],
                         comm, fsdp)
        row["device_timed"] = 1
        return row

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
