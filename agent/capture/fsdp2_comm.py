"""Measured FSDP2 collective time: every all-gather, reduce-scatter and HSDP all-reduce.

Under DDP a comm hook times the all-reduce (``agent.capture.ddp``). FSDP2 has no
such hook: its collectives run inside the ranks' own forward (all-gather of a
unit's parameters) and backward (all-gather again, reduce-scatter of gradients,
and under HSDP an all-reduce across the replicate dimension), so a rank waiting
for a slow peer looks slow in forward or backward itself.

Where the timing sits: FSDP2 issues every collective from one module,
``torch.distributed.fsdp._fully_shard._fsdp_collectives``, through the name
``dist`` it imported (``dist.all_gather_single``, ``dist.reduce_scatter_single``,
``dist.all_reduce``; ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in
older torch). That name is replaced by ``TimedDist``, which forwards every
attribute to ``torch.distributed`` and times only those collectives, calling the
real function with the caller's arguments and returning its result unchanged:
what FSDP2 computes is untouched, no hook is added to any module, and the cost
is per collective (a few per FSDP unit), never per layer. The alternatives were
weaker: FSDP unit hooks (``register_fsdp_forward_prefetch``, pre/post
forward/backward) see when a unit starts and ends, not how much of it was
waiting, and never see HSDP's all-reduce; ``set_custom_all_gather`` replaces
FSDP2's own comm objects and changes which code paths it takes (symmetric memory,
process-group allocation refuse a custom comm). A user's custom comm defined
outside that module is not seen (its time stays in forward/backward).

What is measured, per step, split by phase (forward / backward: which of the
tracer's phases is open) and by mesh dimension (shard: all-gather and
reduce-scatter; replicate: HSDP's all-reduce):

* CPU (gloo): host time inside the call. FSDP2's collectives are synchronous
  there unless the user asked for async unshard, so the call's duration is the
  time the rank sat blocked, waiting for its peers included. An async op (FSDP2
  passes ``async_op`` by name) is timed from launch to its future's completion,
  on the backend's thread: collective time, which may overlap compute.
* CUDA (NCCL): FSDP2 makes the collective's own stream current around the call,
  so two pooled events recorded there (``EventBackend.mark``) bracket the
  collective kernel on the device; they are resolved off the training thread
  with the step's own events (``agent.step_rows``). The host call only launches
  the kernel: its host time is not kept.

While a host collective runs, the step's ``comm_wait`` marker holds its start,
so ``status()`` says the thread waits (a rank waiting for a hung peer is told
from the hung one, as under DDP).

Memory: the shard and full sizes are static (``agent.capture.model.describe``);
on a device backend, the allocated bytes after the root forward (activations
plus whatever shards or unsharded parameters forward left alive) are read once
per step by a forward hook on the traced root module only. On CPU that figure is
not measured (None), and the process RSS sampled at poll time stands for memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

# Accumulator indexes in ``StepRecord.fsdp`` (host) and offsets of the device slots.
FWD_SHARD = 0
BWD_SHARD = 1
FWD_REPLICATE = 2
BWD_REPLICATE = 3
# Device triples use slots past the step's own (agent.capture.record, step_rows._H2D_OUT).
DEVICE_SLOT0 = 7
N_SLOTS = 4
_REPLICATE = FWD_REPLICATE  # added to a phase index: the replicate-dim variant

_COLLECTIVES_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_collectives"
# Collectives FSDP2 calls through its ``dist`` name, and the mesh dimension each runs on.
SHARD_CALLS = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor")
REPLICATE_CALLS = ("all_reduce",)

_perf = time.perf_counter_ns


class Fsdp2Timer:
    """Times one collective call into the active step of the tracer it serves."""

    __slots__ = ("tracer", "calls")

    def __init__(self, tracer: Any) -> None:
        self.tracer = tracer
        self.calls = 0  # collectives timed (tests and the benchmark read it)

    def wrap(self, real: ModuleType, name: str, dim: int) -> Callable[..., Any]:
        """``real.<name>``, timed into the active step (``dim``: 0 shard, ``_REPLICATE``).

        The body is inline (no helper calls on the common path): it runs for every
        collective of every step, on the thread that issues it."""
        timer = self
        perf = _perf

        def collective(*args: Any, **kwargs: Any) -> Any:
            fn = getattr(real, name)  # looked up per call, as FSDP2's own ``dist.<name>`` is
            tracer = timer.tracer
            rec = tracer._active if tracer is not None else None
            if rec is None:  # outside a traced step: the call as it was
                return fn(*args, **kwargs)
            try:
                slot = (BWD_SHARD if rec.bwd_depth else FWD_SHARD) + dim
                backend = tracer._backend
                if backend is not None and not rec.sampled:
                    backend = None  # a host-only step of a device tracer (agent/device_sampling.py)
                ev0 = backend.mark() if backend is not None else None
                t0 = perf()
            except Exception as exc:
                tracer._gate.fail("fsdp2_comm", exc)
                return fn(*args, **kwargs)
            if backend is not None:
                try:
                    return fn(*args, **kwargs)
                finally:
                    try:
                        # Still inside FSDP2's stream context: the end event follows the kernel on its stream.
                        tracer._dev_pair(rec, DEVICE_SLOT0 + slot, ev0)
                        timer.calls += 1
                    except Exception as exc:
                        tracer._gate.fail("fsdp2_comm", exc)
            # status(): the training thread is blocked in a collective (DDP's marker, reused)
            rec.comm_wait = t0
            try:
                work = fn(*args, **kwargs)
            finally:
                rec.comm_wait = 0
            try:
                acc = getattr(rec, "fsdp", None)
                if acc is None:
                    acc = rec.fsdp = [0, 0, 0, 0, []]  # four sums (the indexes above), async completions
                if kwargs and kwargs.get("async_op") and work is not None:
                    _time_async(acc, slot, t0, work)
                else:
                    acc[slot] += perf() - t0
                timer.calls += 1
            except Exception as exc:
                tracer._gate.fail("fsdp2_comm", exc)
            return work

        collective.__name__ = collective.__qualname__ = name
        return collective


def _time_async(acc: list[Any], slot: int, t0: int, work: Any) -> None:
    done: list[tuple[int, int]] = acc[4]

    def finished(_: Any) -> None:
        # The backend's completion thread: list.append is atomic, the sums belong to the training thread.
        done.append((slot, _perf() - t0))

    work.get_future().add_done_callback(finished)


def host_sums(rec: Any) -> list[int] | None:
    """Per-slot host nanoseconds of a finished step; None when no collective was timed."""
    acc = getattr(rec, "fsdp", None)
    if acc is None:
        return None
    sums = list(acc[:N_SLOTS])
    for slot, ns in list(acc[4]):
        sums[slot] += ns
    return sums


def row_fields(sums: list[int] | None) -> dict[str, int | None]:
    """The ``steps`` columns from per-slot sums (None: not measured, never zero)."""
    if sums is None:
        return {"fwd_comm_ns": None, "bwd_comm_ns": None, "replicate_comm_ns": None}
    return {
        "fwd_comm_ns": sums[FWD_SHARD] + sums[FWD_REPLICATE],
        "bwd_comm_ns": sums[BWD_SHARD] + sums[BWD_REPLICATE],
        "replicate_comm_ns": sums[FWD_REPLICATE] + sums[BWD_REPLICATE],
    }


class TimedDist:
    """Stands in for ``torch.distributed`` inside FSDP2's collectives module.

    Any other name is read from the real module the first time and then kept on
    the instance (classes, enums, submodules: FSDP2 reads a few per unit, and a
    ``__getattr__`` per read would cost more than the timing)."""

    def __init__(self, real: ModuleType, timer: Fsdp2Timer) -> None:
        self.__dict__["_real"] = real
        self.__dict__["_timer"] = timer
        # The timed collectives: plain functions in the instance dict (no bound-method call).
        for name in SHARD_CALLS:
            self.__dict__[name] = timer.wrap(real, name, 0)
        for name in REPLICATE_CALLS:
            self.__dict__[name] = timer.wrap(real, name, _REPLICATE)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._real, name)
        if not name.startswith("__"):
            self.__dict__[name] = value
        return value


def _collectives_module() -> ModuleType | None:
    try:
        import importlib

        return importlib.import_module(_COLLECTIVES_MODULE)
    except Exception:
        return None


def install(tracer: Any) -> Callable[[], None] | None:
    """Time FSDP2's collectives for ``tracer``; returns the undo, None where this torch has no such module.

    One proxy per process: a second tracer takes it over (the newest tracer is the one in use)."""
    module = _collectives_module()
    real = getattr(module, "dist", None) if module is not None else None
    if module is None or real is None:
        return None
    if isinstance(real, TimedDist):
        previous = real._timer.tracer
        real._timer.tracer = tracer
        proxy = real
    else:
        previous = None
        proxy = TimedDist(real, Fsdp2Timer(tracer))
        module.dist = proxy  # type: ignore[attr-defined]

    def undo() -> None:
        if module.dist is not proxy:  # type: ignore[attr-defined]
            return
        if proxy._timer.tracer is not tracer:
            return  # another tracer took it over since
        if previous is not None:
            proxy._timer.tracer = previous
        else:
            module.dist = proxy._real  # type: ignore[attr-defined]

    return undo


def timer() -> Fsdp2Timer | None:
    """The installed timer (tests, the benchmark), or None."""
    module = _collectives_module()
    proxy = getattr(module, "dist", None) if module is not None else None
    return proxy._timer if isinstance(proxy, TimedDist) else None


def mesh_degrees(model: torch.nn.Module) -> tuple[int | None, int | None]:
    """(shard, replicate) sizes of the device mesh the FSDP2 parameters live on.

    Read from a parameter's DTensor placements (public API): a ``Shard`` dimension
    is the shard group, a ``Replicate`` one HSDP's replicate group; (None, None)
    when no parameter is a DTensor, replicate None for plain FSDP2 (1-D mesh)."""
    try:
        from torch.distributed.tensor import DTensor
    except Exception:
        return None, None
    for param in model.parameters():
        if not isinstance(param, DTensor):
            continue
        shard: int | None = None
        replicate: int | None = None
        mesh = param.device_mesh
        for i, placement in enumerate(param.placements):
            if placement.is_shard() and shard is None:
                shard = int(mesh.size(i))
            elif placement.is_replicate() and replicate is None:
                replicate = int(mesh.size(i))
        return shard, replicate
    return None, None


def memory_hook(model: torch.nn.Module, tracer: Any) -> Any | None:
    """On a device backend, a forward hook on the root that reads allocated bytes after forward.

    None on CPU (nothing to read cheaply: RSS is sampled at poll time instead)."""
    if tracer._backend is None or not torch.cuda.is_available():
        return None
    read = _allocated_reader()
    fail = tracer._gate.fail

    def post(module: torch.nn.Module, args: Any, output: Any) -> None:
        rec = tracer._active
        if rec is None or not rec.sampled:  # a memory read is a device call: sampled steps only
            return
        try:
            rec.post_fwd = read()
        except Exception as exc:
            fail("fsdp2_memory", exc)

    return model.register_forward_hook(post, always_call=True)


def _allocated_reader() -> Callable[[], int]:
    c = torch._C
    stats = getattr(c, "_cuda_memoryStats", None)
    device = getattr(c, "_cuda_getDevice", None)
    if stats is not None and device is not None:
        # One C call and three lookups; the public memory_allocated() flattens the whole dict in Python.
        return lambda: int(stats(device())["allocated_bytes"]["all"]["current"])
    return lambda: int(torch.cuda.memory_allocated())
