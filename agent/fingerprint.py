"""Numerics fingerprints: per parameter tensor, every N steps, computed on the device.

With ``agent.init(fingerprint_every=N)`` (or ``TRACEML_FINGERPRINT_EVERY=N``) a
traced model's step context is a ``FingerprintStepContext``: at the exit of
every N-th step (after the optimizer ran) it takes, per parameter tensor in
``named_parameters`` order, the L2 norm of the parameter, the L2 norm of its
gradient and the count of non-finite gradient values. One fused
``torch._foreach_norm`` (accumulated in float64) takes every norm; on a GPU a
second one over ``grad * 0`` counts the non-finite values, on the host only
gradients whose norm is non-finite are counted (``_nonfinite_counts``). On a
GPU the results are copied to pinned host memory without blocking and read on
the sender thread once an event says the copy completed, like the step's CUDA
events: nothing synchronizes the device.
Off, models get the plain step context: not one bytecode more per step.

Why these numbers: under DDP every rank's parameters are bitwise equal after
each step, so equal fingerprints are expected and one ULP of drift shows; two
runs of the same seed compare step by step and layer by layer. Under FSDP2
the local shard is fingerprinted (``shard`` = 1) and the daemon adds the
squares of the ranks' norms.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch

from agent.capture.events import CudaEventBackend, EventBackend
from agent.capture.guard import ErrorGate
from agent.config import DEFAULT_FINGERPRINT_EVERY as DEFAULT_FINGERPRINT_EVERY
from agent.tracer import _StepContext

MAX_PENDING = 256  # fingerprints taken but not yet read back; past it the oldest is dropped and counted


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), any other tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class ModelFingerprint:
    """The parameter list of one traced model and the fused calls over it."""

    __slots__ = ("model_id", "names", "params", "sharded")

    def __init__(self, model_id: int, model: torch.nn.Module) -> None:
        self.model_id = model_id
        named = [(n, p) for n, p in model.named_parameters() if p is not None]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.sharded = any(callable(getattr(p, "to_local", None)) for p in self.params)

    def compute(self) -> tuple[torch.Tensor, list[int]] | None:
        """(one float64 tensor: parameter norms, then gradient norms, then non-finite counts of
        the tensors with a gradient; those tensors' positions). Queues device work only."""
        if not self.params:
            return None
        with torch.no_grad():
            params = [_local(p.detach()) for p in self.params]
            with_grad = [i for i, p in enumerate(self.params) if p.grad is not None]
            grads = [_local(self.params[i].grad.detach()) for i in with_grad]  # type: ignore[union-attr]
            # One fused call for every norm, parameters and gradients alike.
            norms = torch.stack(torch._foreach_norm(params + grads, 2, dtype=torch.float64))
            if not grads:
                return norms, with_grad
            return torch.cat((norms, _nonfinite_counts(grads, norms[len(params):]))), with_grad


def _nonfinite_counts(grads: list[torch.Tensor], grad_norms: torch.Tensor) -> torch.Tensor:
    """NaN and infinite values per gradient, as float64. A float64 norm is non-finite exactly
    when a value is, so on the host (where reading the norms synchronizes nothing) only those
    gradients are counted; on a device, one more fused pass counts every one without a wait."""
    if grad_norms.device.type == "cpu":
        finite = torch.isfinite(grad_norms)
        if bool(finite.all()):
            return torch.zeros(len(grads), dtype=torch.float64)
        return torch.tensor([0.0 if ok else float((~torch.isfinite(g)).sum()) for g, ok in
                             zip(grads, finite.tolist(), strict=True)], dtype=torch.float64)
    zeroed = torch._foreach_mul(grads, 0.0)  # NaN where a value is NaN or inf, 0 elsewhere
    return torch.stack(torch._foreach_norm(zeroed, 0, dtype=torch.float64))


class Fingerprints:
    """Every traced model's fingerprints, taken on the training thread, read on the sender thread."""

    def __init__(self, every: int, gate: ErrorGate, max_pending: int = MAX_PENDING) -> None:
        self.every = max(1, int(every))
        self._gate = gate
        # (step, model, values tensor (host copy on a GPU), grad positions, event or None, perf ns)
        self._pending: deque[tuple[int, ModelFingerprint, torch.Tensor, list[int], Any, int]] = deque()
        self.max_pending = max_pending
        self.dropped = 0
        self.taken = 0

    def for_model(self, model_id: int, model: torch.nn.Module) -> ModelFingerprint | None:
        try:
            return ModelFingerprint(model_id, model)
        except Exception as exc:
            self._gate.fail("fingerprint", exc)
            return None

    def take(self, step: int, fp: ModelFingerprint, backend: EventBackend | None) -> None:
        """Training thread, at the exit of a fingerprinted step: queue the device work and its copy."""
        try:
            out = fp.compute()
            if out is None:
                return
            values, with_grad = out
            event = None
            if values.is_cuda and isinstance(backend, CudaEventBackend):
                host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
                host.copy_(values, non_blocking=True)
                event = backend.mark()
                if event is not None:
                    values = host
            if len(self._pending) >= self.max_pending:
                self._drop_oldest(backend)
            self._pending.append((step, fp, values, with_grad, event, time.perf_counter_ns()))
            self.taken += 1
        except Exception as exc:
            self._gate.fail("fingerprint", exc)

    def _drop_oldest(self, backend: EventBackend | None) -> None:
        try:
            event = self._pending.popleft()[4]
        except IndexError:
            return
        if event is not None and backend is not None:
            backend.release(event)
        self.dropped += 1

    def resolve(self, backend: EventBackend | None, timeout_ns: int, final: bool = False) -> list[dict[str, Any]]:
        """Sender thread: rows of every fingerprint whose copy completed, oldest first."""
        rows: list[dict[str, Any]] = []
        now = time.perf_counter_ns()
        while self._pending:
            step, fp, values, with_grad, event, taken = self._pending[0]
            if event is not None and backend is not None and not backend.done(event):
                if not final and now - taken < timeout_ns:
                    break  # in order: later ones are not done either
                self._drop_oldest(backend)
                continue
            self._pending.popleft()
            if event is not None and backend is not None:
                backend.release(event)
            if values.is_cuda:
                self.dropped += 1  # no event to wait on: reading would synchronize the device
                continue
            rows.extend(_rows(step, fp, values.tolist(), with_grad))
        return rows


def _rows(step: int, fp: ModelFingerprint, values: list[float], with_grad: list[int]) -> list[dict[str, Any]]:
    n, g = len(fp.names), len(with_grad)
    grad_norm: list[float | None] = [None] * n
    nonfinite: list[int | None] = [None] * n
    for k, i in enumerate(with_grad):
        grad_norm[i] = values[n + k]
        nonfinite[i] = int(values[n + g + k])
    shard = 1 if fp.sharded else 0
    return [
        {"step": step, "model_id": fp.model_id, "idx": i, "layer": fp.names[i], "param_norm": values[i],
         "grad_norm": grad_norm[i], "grad_nonfinite": nonfinite[i], "shard": shard}
        for i in range(n)
    ]


class FingerprintStepContext(_StepContext):
    """A traced model's step context when fingerprints are on: the plain one, plus a
    fingerprint at the exit of every N-th step that completed (not one that raised)."""

    __slots__ = ("_fp", "_fingerprints")

    def __exit__(self, exc_type: object, exc: object, tb: object) -> bool:
        step = self.steps
        _StepContext.__exit__(self, exc_type, exc, tb)
        try:
            if self.steps != step and step % self._fingerprints.every == 0 and self._fp is not None:
                self._fingerprints.take(step, self._fp, self._tracer._backend)
        except Exception as exc_:
            self._tracer._gate.fail("fingerprint", exc_)
        return False
