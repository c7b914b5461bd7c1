"""Measured DDP collective time: a comm hook wrapping the default all-reduce.

DDP calls a comm hook once per gradient bucket, on the thread that runs
backward, as soon as the bucket's gradients exist; the returned future
completes when the all-reduce is done. Timing launch -> completion per bucket
gives comm time, and last launch -> last completion the time the training
thread sat blocked after compute (see ``record.derive_wait``). The hook
returns exactly what ``allreduce_hook`` returns, so gradients are unchanged.
"""

from __future__ import annotations

from typing import Any

import torch


class CommTimerState:
    __slots__ = ("tracer", "process_group")

    def __init__(self, tracer: Any, process_group: Any) -> None:
        self.tracer = tracer
        self.process_group = process_group


def has_user_comm_hook(ddp: Any) -> bool:
    """True when a comm hook (Python or builtin) is already registered: DDP allows only one."""
    if getattr(ddp, "_comm_hooks", None):
        return True
    try:
        data = ddp._get_ddp_logging_data()
        return bool(data.get("comm_hook"))
    except Exception:
        return False


_allreduce_hook: Any = None


def _default_hook() -> Any:
    # Imported once, not per bucket: an import statement is a dict lookup plus a lock per call.
    global _allreduce_hook
    if _allreduce_hook is None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        _allreduce_hook = allreduce_hook
    return _allreduce_hook


def timed_allreduce(state: CommTimerState, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    allreduce_hook = _allreduce_hook or _default_hook()
    tracer = state.tracer
    rec = tracer._active
    if rec is None:
        return allreduce_hook(state.process_group, bucket)
    start = tracer._comm_begin()
    fut = allreduce_hook(state.process_group, bucket)
    if bucket.is_last():
        # DDP launches buckets in index order once all their gradients exist, so the
        # last launch means backward compute is over: until the collectives complete,
        # the training thread only waits for its peers. Saying "wait" here lets the
        # daemon tell the rank that hangs (still in backward) from those waiting on it.
        tracer._comm_wait(rec)

    def done(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        # Runs on the backend's completion thread; record first, then hand back the
        # averaged bucket (re-raising the collective's own error if it failed).
        tracer._comm_end(rec, start)
        return f.value()

    return fut.then(done)


def attach(ddp: Any, tracer: Any) -> bool:
    """Register the timing hook on a DDP model; False (residual wait) if the user has one."""
    if has_user_comm_hook(ddp):
        return False
    import torch.distributed as dist

    # DDP checks the hook's annotations by identity; under postponed evaluation
    # they are strings, so give it the real objects.
    timed_allreduce.__annotations__.update(
        {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    )
    ddp.register_comm_hook(CommTimerState(tracer, getattr(ddp, "process_group", None)), timed_allreduce)
    return True
