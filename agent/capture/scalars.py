"""``log(name=value)`` scalars, resolved off the training thread.

Floats are emitted at once. Tensors are queued: a CPU tensor is read with
``.item()`` at poll time (cheap, no device); a CUDA tensor is copied into
pinned host memory with a non-blocking copy and an event, and read once the
event completed, so neither thread ever synchronizes the device.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch

from agent.capture.events import CudaEventBackend, EventBackend


class LazyScalars:
    def __init__(self, max_pending: int = 65536) -> None:
        # (step, name, tensor, event or None, perf ns when logged)
        self._pending: deque[tuple[int | None, str, torch.Tensor, Any, int]] = deque()
        self.max_pending = max_pending
        self.dropped = 0

    def add(self, step: int | None, name: str, value: torch.Tensor, backend: EventBackend | None) -> None:
        value = value.detach()
        event = None
        if value.is_cuda and isinstance(backend, CudaEventBackend):
            host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            host.copy_(value, non_blocking=True)
            event = backend.mark()
            if event is not None:
                value = host
        if len(self._pending) >= self.max_pending:
            self._pending.popleft()
            self.dropped += 1
        self._pending.append((step, name, value, event, time.perf_counter_ns()))

    def resolve(self, backend: EventBackend | None, timeout_ns: int, final: bool = False) -> list[dict[str, Any]]:
        """Rows for every scalar that is ready, oldest first; stops at the first not ready."""
        out: list[dict[str, Any]] = []
        now = time.perf_counter_ns()
        while self._pending:
            step, name, value, event, logged = self._pending[0]
            if event is not None and backend is not None and not backend.done(event):
                if not final and now - logged < timeout_ns:
                    break
                self._pending.popleft()
                backend.release(event)
                self.dropped += 1
                continue
            self._pending.popleft()
            if event is not None and backend is not None:
                backend.release(event)
            if value.is_cuda and not final:
                # No event to wait on (pool exhausted / no backend): reading would sync; skip.
                self.dropped += 1
                continue
            number = value.item() if value.numel() == 1 else value.float().mean().item()
            out.append({"step": step, "name": name, "value": float(number)})
        return out
