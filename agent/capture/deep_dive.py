"""Opt-in per-layer deep dive for one sampled step.

Hooks go on leaf modules only for the sampled step and are removed at its
end, so ordinary steps keep the flat two-hook cost. Forward time per layer is
pre -> post hook; activation bytes are the layer's output tensors. Backward
time uses one tensor hook per layer output: the gradient of a layer's output
arrives when its backward starts, and the next arrival (the layer before it)
marks its end; the last one ends with ``backward``. Timings are host clock
(on CUDA they are launch times), which is why this is a sampled diagnostic.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from agent.capture.guard import remove_handles


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    if isinstance(value, dict):
        return [v for v in value.values() if isinstance(v, torch.Tensor)]
    return []


class DeepDive:
    def __init__(self, leaves: list[tuple[str, torch.nn.Module]], gate: Any) -> None:
        n = len(leaves)
        self.names = [name for name, _ in leaves]
        self.fwd = [0] * n
        self.t0 = [0] * n
        self.act = [0] * n
        self.arrivals: list[tuple[int, int]] = []
        self.handles: list[Any] = []
        self._gate = gate
        for i, (_, module) in enumerate(leaves):
            self.handles.append(module.register_forward_pre_hook(self._pre(i)))
            self.handles.append(module.register_forward_hook(self._post(i)))

    def _pre(self, i: int) -> Any:
        def pre(module: torch.nn.Module, args: Any) -> None:
            self.t0[i] = time.perf_counter_ns()

        return pre

    def _post(self, i: int) -> Any:
        def on_grad(grad: torch.Tensor) -> None:
            self.arrivals.append((time.perf_counter_ns(), i))

        def post(module: torch.nn.Module, args: Any, output: Any) -> None:
            try:
                self.fwd[i] += time.perf_counter_ns() - self.t0[i]
                hooked = False
                for t in _tensors(output):
                    self.act[i] += t.numel() * t.element_size()
                    if not hooked and t.requires_grad:
                        t.register_hook(on_grad)
                        hooked = True  # one arrival per call is enough
            except Exception as exc:
                self._gate.fail("deep_dive", exc)

        return post

    def detach(self) -> None:
        remove_handles(self.handles)
        self.handles = []

    def rows(self, step: int, backward_end: int) -> list[dict[str, Any]]:
        bwd = [0] * len(self.names)
        seen = [False] * len(self.names)
        arrivals = sorted(self.arrivals)
        for k, (t, i) in enumerate(arrivals):
            end = arrivals[k + 1][0] if k + 1 < len(arrivals) else backward_end
            bwd[i] += max(0, end - t)
            seen[i] = True
        return [
            {
                "step": step,
                "layer": name,
                "forward_ns": self.fwd[i],
                "backward_ns": bwd[i] if seen[i] else None,
                "activation_bytes": self.act[i],
            }
            for i, name in enumerate(self.names)
        ]
