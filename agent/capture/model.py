"""What a traced model is (parallelism, sizes) and how its forward is timed.

Only the module handed to ``trace_step`` is instrumented, whatever its depth,
so the per-step cost is flat in the number of submodules. Two mechanisms:

* ``TimedCall`` (the default): ``nn.Module.__call__`` looks ``self._call_impl``
  up on the instance, so a wrapper in the model's own ``__dict__`` under that
  name runs around the whole call, after which torch's ``_call_impl`` takes its
  fast path (no hooks on the module). Forward hooks instead send the root's
  ``_call_impl`` down the slow path (a closure, a set, tuple unpacking,
  per-hook dict lookups), which costs about twice the wrapper in a real step
  (bench/overhead.py's ``null_fwd_hooks`` / ``null_fwd_wrap`` controls). The
  wrapper times exactly what the hooks timed plus any other forward hooks on the module (they run inside ``_call_impl``), and
  like hooks it does not see ``model.forward(x)`` called directly (the daemon
  reports that as missing forward); ``model.forward`` itself is left alone
  (introspection, libraries that wrap it).
* a forward pre-hook and post-hook: FSDP2 (kept on the mechanism its
  attribution was validated with), a class with its own ``__call__``
  (``torch.compile``'s ``OptimizedModule``) or ``_call_impl``, and a torch
  whose ``Module.__call__`` no longer dispatches through ``self._call_impl``.

Under DDP the instrumentation sits on the DDP module the user calls, so DDP's
own pre-forward work (buffer broadcast) counts as forward.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from agent.capture.guard import remove_handles
from agent.capture.record import FORWARD

# The clock as a module global: the hot path reads it with a specialized LOAD_GLOBAL, where
# ``self._perf()`` would be a generic method load (3.11 does not specialize slot callables).
_perf = time.perf_counter_ns


class ModelInfo:
    __slots__ = ("name", "parallelism", "n_modules", "param_bytes", "local_shard_bytes", "estimated_full_bytes",
                 "shard_degree", "replicate_degree")

    def __init__(self, name: str, parallelism: str, n_modules: int, param_bytes: int,
                 local_shard_bytes: int | None, estimated_full_bytes: int | None,
                 shard_degree: int | None = None, replicate_degree: int | None = None) -> None:
        self.name = name
        self.parallelism = parallelism
        self.n_modules = n_modules
        self.param_bytes = param_bytes
        self.local_shard_bytes = local_shard_bytes
        self.estimated_full_bytes = estimated_full_bytes
        # FSDP2's device mesh: ranks sharing one copy (shard) and copies (HSDP replicate).
        self.shard_degree = shard_degree
        self.replicate_degree = replicate_degree

    def row(self, model_id: int) -> dict[str, Any]:
        return {
            "model_id": model_id,
            "name": self.name,
            "parallelism": self.parallelism,
            "n_modules": self.n_modules,
            "param_bytes": self.param_bytes,
            "local_shard_bytes": self.local_shard_bytes,
            "estimated_full_bytes": self.estimated_full_bytes,
            "shard_degree": self.shard_degree,
            "replicate_degree": self.replicate_degree,
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
        from agent.capture.fsdp2_comm import mesh_degrees

        shard, replicate = mesh_degrees(model)
        return ModelInfo(name, "fsdp2", n_modules, local, local, full, shard, replicate)
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
                if backend is not None and rec.sampled:
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
                if backend is not None and rec.sampled:
                    tracer._dev_pair(rec, FORWARD, rec.fwd_ev0)
                    rec.fwd_ev0 = None
            rec.fwd_depth = depth - 1
        except Exception as exc:
            fail("forward", exc)

    # prepend: run before wrapper hooks (FSDP2 all-gather) so they count as forward;
    # always_call: an exception in forward still closes the phase.
    return [model.register_forward_pre_hook(pre, prepend=True), model.register_forward_hook(post, always_call=True)]


def _call_dispatches_through_instance() -> bool:
    """Does ``nn.Module.__call__`` still call ``self._call_impl`` (torch 2.x)? Checked once."""
    call = torch.nn.Module.__call__
    code = getattr(call, "__code__", None)
    return code is not None and "_call_impl" in code.co_names and "_compiled_call_impl" in code.co_names


_DISPATCH_OK: bool | None = None


def wants_hooks(model: torch.nn.Module, info: ModelInfo) -> bool:
    """True where forward must be timed by hooks rather than a TimedCall (module docstring)."""
    global _DISPATCH_OK
    if _DISPATCH_OK is None:
        _DISPATCH_OK = _call_dispatches_through_instance()
    cls = type(model)
    return (
        not _DISPATCH_OK
        or info.parallelism == "fsdp2"
        or cls.__call__ is not torch.nn.Module.__call__
        or cls._call_impl is not torch.nn.Module._call_impl
        or "_call_impl" in model.__dict__
    )


class TimedCall:
    """A traced model's ``_call_impl``, timed; lives in the model's instance ``__dict__``.

    The same phase as the two hooks of ``hook_forward`` (the start written before
    the depth for ``status()``, closed on an exception too), in one call instead of
    torch's hook dispatch. Only the outermost forward of a step is timed: a call
    made while the step's forward depth is already raised (a traced model inside
    another's forward, whichever mechanism raised it) passes straight through,
    so nesting costs no bookkeeping. Holds the model weakly: a strong
    reference from the model's own dict would make every traced model a reference
    cycle, freed (with its GPU memory) only by a full garbage collection.

    Copies behave like copied hooks did: ``copy.deepcopy(model)`` (an EMA or a
    teacher) gets a TimedCall of its own, bound to the copy, so the copy runs its
    own weights and its forward inside a step counts as forward. Pickling
    (``torch.save(model)``) stores the plain ``_call_impl`` in its place, so a
    loaded model is untraced. ``model.compile()`` after the first traced step
    compiles this wrapper (read through ``self._call_impl``), as it compiled the
    hooks before; dynamo then breaks the graph at the clock read, as it did there.
    """

    __slots__ = ("_ref", "_fn", "_tracer", "_backend", "_fail", "__weakref__")

    def __init__(self, model: torch.nn.Module, tracer: Any) -> None:
        self._ref = weakref.ref(model)
        self._fn = type(model)._call_impl  # what __call__ would have called
        self._tracer = tracer
        self._backend = tracer._backend  # fixed for the Tracer's lifetime
        self._fail = tracer._gate.fail

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        rec = self._tracer._active
        if rec is None or rec.fwd_depth:
            # Outside a traced step (evaluation, another library), or inside a forward this
            # step already times (D(G(z)), a traced submodule): the outermost call counts it.
            return self._fn(self._ref(), *args, **kwargs)
        try:
            rec.fwd_t0 = _perf()  # before the depth: status() reads the start once depth > 0
            if self._backend is not None and rec.sampled:
                rec.fwd_ev0 = self._backend.mark()
            rec.fwd_depth = 1
        except Exception as exc:
            self._fail("forward", exc)
        ref = self._ref  # a plain load: self._ref() would be a generic method load on a slot
        try:
            return self._fn(ref(), *args, **kwargs)
        finally:
            # Closed on an exception too (what always_call=True gave the post-hook).
            try:
                if rec.fwd_depth:  # 0: the opening above failed
                    t = _perf()
                    rec.fwd += t - rec.fwd_t0
                    rec.ph_end = t
                    if self._backend is not None and rec.sampled:
                        self._tracer._dev_pair(rec, FORWARD, rec.fwd_ev0)
                        rec.fwd_ev0 = None
                    rec.fwd_depth = 0
            except Exception as exc:
                self._fail("forward", exc)

    def install(self) -> TimedCall:
        model = self._ref()
        if model is not None:
            # Straight into the dict: nn.Module.__setattr__ has nothing to register for it.
            model.__dict__["_call_impl"] = self
        return self

    def remove(self) -> None:
        """Uninstall (a hook handle's interface, for remove_handles)."""
        model = self._ref()
        if model is not None and model.__dict__.get("_call_impl") is self:
            del model.__dict__["_call_impl"]
        # Still referenced elsewhere (a model.compile() made meanwhile): the uninstalled
        # tracer has no active step, so every call passes straight through.

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        model = self._ref()
        # copy.deepcopy registers the new model in memo before copying its __dict__.
        new = memo.get(id(model)) if model is not None else None
        if new is None:  # a dict deep-copied on its own: share, as a function would be
            return self
        return TimedCall(new, self._tracer)

    def __reduce__(self) -> Any:
        model = self._ref()
        if model is None:
            raise TypeError("cannot pickle the call of a model that no longer exists")
        # Unpickled, this reads the class's _call_impl off the new model (not yet carrying
        # any state): the loaded model runs untraced.
        return (getattr, (model, "_call_impl"))


def time_forward(model: torch.nn.Module, info: ModelInfo, tracer: Any) -> list[Any]:
    """Instrument ``model``'s forward (module docstring); the handles undo it."""
    if wants_hooks(model, info):
        return hook_forward(model, tracer)
    return [TimedCall(model, tracer).install()]
