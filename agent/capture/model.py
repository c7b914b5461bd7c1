"""What a traced model is (parallelism, sizes) and its two forward hooks.

Only the module handed to ``trace_step`` is hooked (one pre and one post
hook), whatever its depth, so the per-step cost is flat in the number of
submodules. Under DDP or FSDP2 the hooks sit on the wrapper the user calls,
so the wrapper's own pre-forward work (buffer broadcast, all-gather) counts
as forward.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from agent.capture.guard import remove_handles
from agent.capture.record import FORWARD


class ModelInfo:
    __slots__ = ("name", "parallelism", "n_modules", "param_bytes", "local_shard_bytes", "estimated_full_bytes")

    def __init__(self, name: str, parallelism: str, n_modules: int, param_bytes: int,
                 local_shard_bytes: int | None, estimated_full_bytes: int | None) -> None:
        self.name = name
        self.parallelism = parallelism
        self.n_modules = n_modules
        self.param_bytes = param_bytes
        self.local_shard_bytes = local_shard_bytes
        self.estimated_full_bytes = estimated_full_bytes

    def row(self, model_id: int) -> dict[str, Any]:
        return {
            "model_id": model_id,
            "name": self.name,
            "parallelism": self.parallelism,
            "n_modules": self.n_modules,
            "param_bytes": self.param_bytes,
            "local_shard_bytes": self.local_shard_bytes,
            "estimated_full_bytes": self.estimated_full_bytes,
        }


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor

        return DTensor
    except Exception:
        return None


def _fsdp_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule

        return FSDPModule
    except Exception:
        return None


def _is_ddp(model: torch.nn.Module) -> bool:
    try:
        from torch.nn.parallel import DistributedDataParallel
    except Exception:
        return False
    return isinstance(model, DistributedDataParallel)


def describe(model: torch.nn.Module | None) -> ModelInfo:
    """Parallelism and sizes, computed once per model (walks modules and parameters)."""
    if model is None:
        return ModelInfo("none", "single", 0, 0, None, None)
    dtensor = _dtensor_type()
    fsdp_module = _fsdp_module_type()
    n_modules = 0
    fsdp2 = False
    for module in model.modules():
        n_modules += 1
        if fsdp_module is not None and isinstance(module, fsdp_module):
            fsdp2 = True
    local = 0
    full = 0
    for param in model.parameters():
        size = param.element_size()
        if dtensor is not None and isinstance(param, dtensor):
            fsdp2 = True
            # A DTensor's numel() is the global size; the shard this rank holds is to_local().
            local += param.to_local().numel() * size
        else:
            local += param.numel() * size
        full += param.numel() * size
    inner = model.module if _is_ddp(model) else model
    name = type(inner).__name__
    if fsdp2:
        return ModelInfo(name, "fsdp2", n_modules, local, local, full)
    return ModelInfo(name, "ddp" if _is_ddp(model) else "single", n_modules, local, None, None)


def leaf_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(name or type(m).__name__, m) for name, m in model.named_modules() if next(m.children(), None) is None]


class ModelState:
    """Per traced model: id, step counter, hooks, the step in progress."""

    __slots__ = ("model_id", "ref", "info", "steps", "handles", "current", "nest", "leaves", "comm_hooked",
                 "__weakref__")

    def __init__(self, model_id: int, model: torch.nn.Module | None, info: ModelInfo) -> None:
        self.model_id = model_id
        self.ref: Callable[[], Any] = weakref.ref(model) if model is not None else (lambda: None)
        self.info = info
        self.steps = 0
        self.handles: list[Any] = []
        self.current: Any = None
        self.nest = 0
        self.leaves: list[tuple[str, torch.nn.Module]] | None = None
        self.comm_hooked = False

    def remove_hooks(self) -> None:
        remove_handles(self.handles)
        self.handles = []


def hook_forward(model: torch.nn.Module, tracer: Any) -> list[Any]:
    """Register the pre/post forward hooks; they attribute to whatever step is active.

    A traced model called inside another model's step (GAN: D(G(z))) counts as
    forward of the active step; nesting is tracked so time is counted once.

    The bodies are inlined (locals bound once here, no call into the Tracer on
    CPU): any hook already sends ``nn.Module._call_impl`` down its slow path,
    so the hooks themselves must add as little as possible. The event backend
    is fixed for the Tracer's lifetime, hence bound here too.
    """
    perf = time.perf_counter_ns
    backend = tracer._backend
    fail = tracer._gate.fail

    def pre(module: torch.nn.Module, args: Any) -> None:
        rec = tracer._active
        if rec is None:
            return
        try:
            depth = rec.fwd_depth
            if depth == 0:
                rec.fwd_t0 = perf()  # before the depth: status() reads the start once depth > 0
                if backend is not None:
                    rec.fwd_ev0 = backend.mark()
            rec.fwd_depth = depth + 1
        except Exception as exc:
            fail("forward", exc)

    def post(module: torch.nn.Module, args: Any, output: Any) -> None:
        rec = tracer._active
        if rec is None:
            return
        try:
            depth = rec.fwd_depth
            if depth <= 0:  # entered before the step opened: nothing to close
                return
            if depth == 1:
                t = perf()
                rec.fwd += t - rec.fwd_t0
                rec.ph_end = t
                if backend is not None:
                    tracer._dev_pair(rec, FORWARD, rec.fwd_ev0)
                    rec.fwd_ev0 = None
            rec.fwd_depth = depth - 1
        except Exception as exc:
            fail("forward", exc)

    # prepend: run before wrapper hooks (FSDP2 all-gather) so they count as forward;
    # always_call: an exception in forward still closes the phase.
    return [model.register_forward_pre_hook(pre, prepend=True), model.register_forward_hook(post, always_call=True)]
