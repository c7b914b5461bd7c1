"""The tracer's set-up side: global patches, traced models and the backend choice.

``Tracer`` inherits these methods; its slots hold the state (``agent.tracer``).
They run once per model (its first ``trace_step``) or at install and
uninstall, never per step: each model gets its step context
(``agent.tracer._StepContext``) with its call wrapper installed here, so the
step path is one dict lookup.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from agent.capture import autograd, dataloader, ddp, fsdp2_comm, h2d, optimizer
from agent.capture.events import EventBackend
from agent.capture.guard import ErrorGate
from agent.capture.model import ModelState, describe, leaf_modules, time_forward
from agent.capture.record import StepRecord


class ModelsMixin:
    """Install/uninstall, model registration and the automatic backend's confirmation."""

    __slots__ = ()
    # Slots of Tracer that these methods use.
    _active: StepRecord | None
    _models: dict[int, ModelState]
    _none_state: ModelState | None
    _next_model_id: int
    _backend: EventBackend | None
    _backend_undecided: bool
    _pending: deque[StepRecord]
    _max_pending: int
    _steps_done: int
    _deep_dive: bool
    _cuda: bool
    _undo: list[Callable[[], None]]
    _installed: bool
    _gate: ErrorGate
    _fingerprints: Any  # agent.fingerprint.Fingerprints, None when off
    _emit: Callable[[str, dict[str, Any]], None]  # StepRowsMixin's

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
        from agent.tracer import _StepContext  # the step path's module imports this one

        if not self._installed:
            self.install()
        if self._backend_undecided:
            self._decide_backend()
        info = describe(model)
        if self._fingerprints is not None and model is not None:
            state = self._fingerprinted_state(model, info)
        else:
            state = _StepContext(self, self._next_model_id, model, info)
        self._next_model_id += 1
        if model is not None:
            state.handles = time_forward(model, info, self)
            if info.parallelism == "ddp":
                try:
                    state.comm_hooked = ddp.attach(model, self)
                except Exception as exc:
                    self._gate.fail("ddp_comm_hook", exc)
            if info.parallelism == "fsdp2":
                self._attach_fsdp2(model, state)
            elif self._deep_dive:
                state.leaves = leaf_modules(model)
            key = id(model)

            def forget(_: object, key: int = key, state: ModelState = state) -> None:
                if self._models.get(key) is state:
                    del self._models[key]

            state.ref = weakref.ref(model, forget)
        self._emit("models", info.row(state.model_id))
        return state

    def _attach_fsdp2(self, model: torch.nn.Module, state: ModelState) -> None:
        """FSDP2: time its collectives (once per process), read memory after forward; no layer hooks."""
        try:
            if self._deep_dive:
                # Per-layer hooks would fire around FSDP2's unshard and see only shard fragments.
                self._gate.notice("deep_dive_fsdp2", f"per-layer deep dive skipped: {type(model).__name__} is "
                                  "FSDP2; step phases, collective wait and shard memory are reported instead")
            if not any(getattr(undo, "fsdp2_comm", False) for undo in self._undo):
                undo = fsdp2_comm.install(self)
                if undo is not None:
                    undo.fsdp2_comm = True  # type: ignore[attr-defined]
                    self._undo.append(undo)
            handle = fsdp2_comm.memory_hook(model, self)
            if handle is not None:
                state.handles.append(handle)
        except Exception as exc:
            self._gate.fail("fsdp2_attach", exc)

    def _fingerprinted_state(self, model: torch.nn.Module, info: Any) -> ModelState:
        """The step context that also fingerprints the model every N steps (agent.fingerprint)."""
        from agent.fingerprint import FingerprintStepContext

        state = FingerprintStepContext(self, self._next_model_id, model, info)
        state._fingerprints = self._fingerprints
        state._fp = self._fingerprints.for_model(self._next_model_id, model)
        return state

    def _decide_backend(self) -> None:
        """Keep the automatic CUDA backend only if this process uses CUDA.

        Decided once, when the first model is traced (its parameters are where they
        will train by then). A CPU job on a GPU machine would otherwise record CUDA
        events on an idle device every step and make each rank create a CUDA context
        (GPU memory and start-up time) for nothing.
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
