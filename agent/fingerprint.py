"""Numerics fingerprints: per parameter tensor, every N steps, computed on the device.

With ``agent.init(fingerprint_every=N)`` (or ``TRACEML_FINGERPRINT_EVERY=N``) a
traced model's step context is a ``FingerprintStepContext``: at the exit of
every N-th step (after the optimizer ran) it takes, per parameter tensor in
``named_parameters`` order, the sum of the parameter's bits as integers
(``bit_sum``, wrapping int32), the L2 norms of the parameter and of its
gradient (one fused ``torch._foreach_norm`` over all of them, float32
accumulation) and the count of non-finite gradient values. On the host the
gradient norms are read at once and only a gradient whose norm is non-finite
is counted; on a GPU a second fused norm over ``grad * 0`` counts them all,
the results are copied to pinned host memory without blocking and read on the
sender thread once an event says the copy completed, like the step's CUDA
events: nothing synchronizes the device.
Off, models get the plain step context: not one bytecode more per step.

Why these numbers: under DDP every rank's parameters are bitwise equal after
each step, so equal bit sums are expected and one ULP of drift in one element
changes one (a float norm would hide a small element's ULP in rounding); two
runs of the same seed compare step by step and layer by layer. The norms give
the magnitudes and a tolerance for ``compare --ulp``. Under FSDP2 the local
shard is fingerprinted (``shard`` = 1) and the daemon adds the squares of the
ranks' norms and their bit sums.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any

import numpy as np
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


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers of its own width (32-bit halves for 8-byte floats: a
    one-ULP change moves their sum by +-1 or +-2). A view of the tensor's memory, except for an
    8-byte tensor whose elements are not adjacent (a copy)."""
    size = t.element_size()
    if size != 8:
        return t.view({4: torch.int32, 2: torch.int16, 1: torch.int8}[size])
    flat = t.reshape(-1)
    return (flat if flat.stride(0) == 1 else flat.contiguous()).view(torch.int32)


def bit_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of the tensor's bits as integers, wrapping in int32. Integer addition is exact and
    order-free, so equal tensors give equal sums on any device, kernel or thread count, a
    one-ULP change of one element always changes the sum, and shards' sums add up (mod 2**32)
    to the whole tensor's."""
    return _bits(t).sum(dtype=torch.int32)


class ModelFingerprint:
    """The parameter list of one traced model and the calls over it."""

    __slots__ = ("model_id", "names", "params", "sharded", "acc_dtype", "_views", "_host", "_ptrs", "_copies")

    def __init__(self, model_id: int, model: torch.nn.Module) -> None:
        self.model_id = model_id
        named = [(n, p) for n, p in model.named_parameters() if p is not None]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.sharded = any(callable(getattr(p, "to_local", None)) for p in self.params)
        # Norms accumulate in float32 (float64 for a float64 model): equality is the bit sums' job.
        self.acc_dtype = torch.float64 if any(p.dtype == torch.float64 for p in self.params) else torch.float32
        # Views of the parameters' memory, made again when a storage moves: integer views for
        # the device path; on the host, when numpy can read every parameter in place, numpy
        # arrays (values, int32 bits), else None.
        self._views: list[torch.Tensor] = []
        self._host: list[tuple[np.ndarray, np.ndarray]] | None = None
        self._ptrs: list[int] = []
        self._copies = False  # a view is a copy (see _bits): made again at every fingerprint

    def _moved(self) -> bool:
        ptrs = [p.data_ptr() for p in self.params]
        if ptrs == self._ptrs and not self._copies:
            return False
        self._ptrs = ptrs
        self._views = [_bits(p.detach()) for p in self.params]
        self._copies = any(v.data_ptr() != p for v, p in zip(self._views, ptrs, strict=True))
        self._host = None if self._copies else _host_views(self.params)
        return True

    def compute(self) -> Taken | None:
        """Queue the fingerprint's device work: the parameters' bit sums (int32), then one fused
        norm over every parameter and gradient. On the host the work is done in place (numpy
        over the same memory, BLAS for the squares), the gradient norms are read at once (that
        waits for nothing) and only a non-finite one has its values counted."""
        if not self.params:
            return None
        with torch.no_grad():
            if self.sharded:
                views = [_bits(_local(p.detach())) for p in self.params]
            else:
                self._moved()
                views = self._views
                if self._host is not None:
                    try:
                        return self._compute_host(self._host)
                    except (TypeError, RuntimeError):
                        pass  # a gradient numpy cannot read in place (another dtype, device): torch's way
            sums = torch.stack([v.sum(dtype=torch.int32) for v in views])
            params = [_local(p.detach()) for p in self.params] if self.sharded else self.params
            with_grad = [i for i, p in enumerate(self.params) if p.grad is not None]
            grads = [_local(self.params[i].grad.detach()) for i in with_grad]  # type: ignore[union-attr]
            norms = torch.stack(torch._foreach_norm(params + grads, 2, dtype=self.acc_dtype))
            if norms.device.type == "cpu":
                values = norms.tolist()
                return Taken(values, sums, with_grad, _host_counts(grads, values[len(params):]))
            if grads:  # no wait on a device: count every gradient's non-finite values there
                zeroed = torch._foreach_mul(grads, 0.0)  # NaN where a value is NaN or inf, 0 elsewhere
                norms = torch.cat((norms, torch.stack(torch._foreach_norm(zeroed, 0, dtype=self.acc_dtype))))
            return Taken(norms, sums, with_grad, None)

    def _compute_host(self, host: list[tuple[np.ndarray, np.ndarray]]) -> Taken:
        """Host parameters: per tensor the int32 bit sum and the sums of squares (BLAS dot),
        roots taken on the sender thread."""
        add, dot = np.add.reduce, np.dot
        sums: list[Any] = []
        squares: list[Any] = []
        grad_squares: list[Any] = []
        with_grad: list[int] = []
        grads: list[np.ndarray] = []
        for i, (p, (values, bits)) in enumerate(zip(self.params, host, strict=True)):
            sums.append(add(bits, dtype=np.int32))
            squares.append(dot(values, values))
            g = p.grad
            if g is not None:
                a = g.numpy().reshape(-1)
                with_grad.append(i)
                grads.append(a)
                grad_squares.append(dot(a, a))
        if all(map(math.isfinite, grad_squares)):
            counts = [0] * len(grads)
        else:
            counts = [0 if math.isfinite(sq) else int(np.count_nonzero(~np.isfinite(a)))
                      for a, sq in zip(grads, grad_squares, strict=True)]
        return Taken(squares + grad_squares, sums, with_grad, counts, squared=True)


def _host_views(params: list[torch.nn.Parameter]) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """numpy arrays over the parameters' own memory (values, bits as int32), or None when one
    is not a contiguous float32/float64 host tensor (numpy would copy it, or cannot read it)."""
    out: list[tuple[np.ndarray, np.ndarray]] = []
    for p in params:
        t = p.detach()
        if t.device.type != "cpu" or t.dtype not in (torch.float32, torch.float64) or not t.is_contiguous():
            return None
        values = t.numpy().reshape(-1)
        out.append((values, values.view(np.int32)))
    return out


class Taken:
    """One fingerprint between the training thread and the sender: the norms (parameters, then
    gradients, then on a device the gradients' non-finite counts; ``squared``: their squares,
    numpy scalars, roots still to take), the bit sums, the positions of the tensors with a
    gradient, and on the host the non-finite counts."""

    __slots__ = ("norms", "sums", "with_grad", "counts", "squared")

    def __init__(self, norms: torch.Tensor | list[Any], sums: torch.Tensor | list[Any], with_grad: list[int],
                 counts: list[int] | None, squared: bool = False) -> None:
        self.norms = norms
        self.sums = sums
        self.with_grad = with_grad
        self.counts = counts
        self.squared = squared

    def on_device(self) -> bool:
        return isinstance(self.sums, torch.Tensor) and self.sums.is_cuda


def _host_counts(grads: list[torch.Tensor], grad_norms: list[float]) -> list[int]:
    """NaN and infinite values per gradient. A norm is non-finite whenever a value is, so only
    those gradients are counted (a norm past float32's range counts 0 there, as it should)."""
    if math.isfinite(sum(grad_norms)):
        return [0] * len(grads)
    return [0 if math.isfinite(n) else int((~torch.isfinite(g)).sum()) for g, n in zip(grads, grad_norms, strict=True)]


class Fingerprints:
    """Every traced model's fingerprints, taken on the training thread, read on the sender thread."""

    def __init__(self, every: int, gate: ErrorGate, max_pending: int = MAX_PENDING) -> None:
        self.every = max(1, int(every))
        self._gate = gate
        # (step, model, what was taken (host copies on a GPU), event or None, perf ns)
        self._pending: deque[tuple[int, ModelFingerprint, Taken, Any, int]] = deque()
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
            taken = fp.compute()
            if taken is None:
                return
            event = None
            if taken.on_device() and isinstance(backend, CudaEventBackend):
                host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                        for t in (taken.norms, taken.sums)]  # type: ignore[union-attr]
                host[0].copy_(taken.norms, non_blocking=True)  # type: ignore[arg-type]
                host[1].copy_(taken.sums, non_blocking=True)  # type: ignore[arg-type]
                event = backend.mark()
                if event is not None:
                    taken.norms, taken.sums = host
            if len(self._pending) >= self.max_pending:
                self._drop_oldest(backend)
            self._pending.append((step, fp, taken, event, time.perf_counter_ns()))
            self.taken += 1
        except Exception as exc:
            self._gate.fail("fingerprint", exc)

    def _drop_oldest(self, backend: EventBackend | None) -> None:
        try:
            event = self._pending.popleft()[3]
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
            step, fp, taken, event, at = self._pending[0]
            if event is not None and backend is not None and not backend.done(event):
                if not final and now - at < timeout_ns:
                    break  # in order: later ones are not done either
                self._drop_oldest(backend)
                continue
            self._pending.popleft()
            if event is not None and backend is not None:
                backend.release(event)
            if taken.on_device():
                self.dropped += 1  # no event to wait on: reading would synchronize the device
                continue
            rows.extend(_rows(step, fp, taken))
        return rows


def _rows(step: int, fp: ModelFingerprint, taken: Taken) -> list[dict[str, Any]]:
    values = taken.norms if isinstance(taken.norms, list) else taken.norms.tolist()
    if taken.squared:
        values = [float(np.sqrt(v)) for v in values]  # in the squares' own precision
    sums = [int(v) for v in (taken.sums if isinstance(taken.sums, list) else taken.sums.tolist())]
    n, g = len(fp.names), len(taken.with_grad)
    counts = taken.counts if taken.counts is not None else [int(c) for c in values[n + g:]]
    grad_norm: list[float | None] = [None] * n
    nonfinite: list[int | None] = [None] * n
    for k, i in enumerate(taken.with_grad):
        grad_norm[i] = values[n + k]
        nonfinite[i] = counts[k]
    shard = 1 if fp.sharded else 0
    return [
        {"step": step, "model_id": fp.model_id, "idx": i, "layer": fp.names[i], "param_norm": values[i],
         "grad_norm": grad_norm[i], "grad_nonfinite": nonfinite[i], "shard": shard, "param_sum": sums[i]}
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
