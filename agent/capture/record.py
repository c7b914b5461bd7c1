"""Per-step state filled by the hooks and patches while a step runs.

One ``StepRecord`` per traced step. Hooks add host nanoseconds straight into
slots (no dicts, no string keys on the hot path); on a device backend they
also append ``(slot, start_event, end_event)`` triples resolved later in
``poll()``.

The record also carries what ``Tracer.status()`` reads to say which phase the
training thread is in: the nesting depths, each open phase's start time and
``ph_end`` (when the last phase closed, i.e. since when the step has been
"waiting"). Hooks write the start time before raising the depth and the end
time before lowering it, so a reader on another thread sees at worst the
previous phase for the instant between two stores; no tuple is allocated
per phase change.
"""

from __future__ import annotations

from typing import Any

# Slot numbers used in device triples and phase accumulators.
DATALOADER = 0
H2D = 1
FORWARD = 2
BACKWARD = 3
OPTIMIZER = 4
COMM = 5

# Status phases (interned strings; Tracer.status() derives which one holds).
IDLE = "idle"
PH_DATALOADER = "dataloader"
PH_H2D = "h2d"
PH_FORWARD = "forward"
PH_BACKWARD = "backward"
PH_OPTIMIZER = "optimizer"
PH_WAIT = "wait"


class StepRecord:
    # Order matters a little: slots lie in declaration order, so the fields every host
    # step touches come first and share as few cache lines as possible (a step runs with
    # cold caches; see agent/tracer.py); device-only fields follow.
    __slots__ = (
        "model_id",
        "step",
        "t_enter",
        "t_exit",
        "prev",
        # host ns accumulated inside the step
        "dl_in",
        "dl_out",
        "h2d",
        "h2d_out",
        "fwd",
        "bwd",
        "opt",
        # nesting/start bookkeeping
        "fwd_depth",
        "fwd_t0",
        "bwd_depth",
        "bwd_end",
        "opt_t0",
        "opt_depth",
        # status: when the last phase closed; when DDP launched its last bucket (0: not yet)
        "ph_end",
        "comm_wait",
        "has_dl",
        # DDP comm hook: host (start, end) per bucket, None when not measured
        "comm",
        "deep",
        # device timing: None on CPU; else enter/exit events and triples
        "fwd_ev0",
        "bwd_ev0",
        "opt_ev0",
        "ev_enter",
        "ev_exit",
        "dev",
        "dev_lost",
        "sampled",  # this step carries device timing (agent/device_sampling.py)
        "dev_cost",  # host ns the step's enter spent in device calls
        "peak_bytes",
        "reserved_bytes",
        # FSDP2 (agent.capture.fsdp2_comm): host collective sums, allocated bytes after forward.
        # Unset unless a traced FSDP2 step sets them; readers use getattr with a None default.
        "fsdp",
        "post_fwd",
    )

    # No __init__: a step opens on the training thread, where a Python-level
    # __init__ is one more frame per step. The tracer's step enter
    # (agent.tracer._StepContext.__enter__) creates records with ``StepRecord()``
    # (C's object_new, no frame) and sets every field the host path reads before
    # writing; device fields are set by ``init_device``; fwd_t0/bwd_end/t_exit
    # are written before any read; the row builder reads peak/reserved bytes
    # with a None default.

    def init_device(self, sampled: bool) -> None:
        """The device-path fields (CUDA events, memory), unset on the host path. Every
        step of a device tracer has them; only a ``sampled`` one records events."""
        self.sampled = sampled
        self.dev_cost = 0
        self.fwd_ev0: Any = None
        self.bwd_ev0: Any = None
        self.opt_ev0: Any = None
        self.ev_enter: Any = None
        self.ev_exit: Any = None
        self.dev: list[tuple[int, Any, Any]] | None = None
        self.dev_lost = False
        self.peak_bytes: int | None = None
        self.reserved_bytes: int | None = None


def derive_wait(comm: list[tuple[int, int]] | None) -> tuple[int | None, int | None]:
    """(comm_ns, wait_ns) from per-bucket (launch, completion) times.

    The last bucket is launched when backward compute ends (DDP fires a
    bucket's hook once all its grads exist), so the training thread is blocked
    from the last launch until the last completion: that is the wait.
    """
    if not comm:
        return None, None
    total = 0
    last_start = comm[0][0]
    last_end = comm[0][1]
    for start, end in comm:
        total += max(0, end - start)
        if start > last_start:
            last_start = start
        if end > last_end:
            last_end = end
    return total, max(0, last_end - last_start)
