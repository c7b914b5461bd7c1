"""Per-step state filled by the hooks and patches while a step runs.

One ``StepRecord`` per traced step. Hooks add host nanoseconds straight into
slots (no dicts, no string keys on the hot path); on a device backend they
also append ``(slot, start_event, end_event)`` triples resolved later in
``poll()``. Slots index ``PHASE_NAMES``.
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

# Status phases (interned strings, assigned as-is on the hot path).
IDLE = "idle"
PH_DATALOADER = "dataloader"
PH_H2D = "h2d"
PH_FORWARD = "forward"
PH_BACKWARD = "backward"
PH_OPTIMIZER = "optimizer"
PH_WAIT = "wait"


class StepRecord:
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
        "fwd_ev0",
        "bwd_depth",
        "bwd_end",
        "bwd_ev0",
        "opt_t0",
        "opt_depth",
        "opt_ev0",
        # DDP comm hook: host (start, end) per bucket, None when not measured
        "comm",
        # device timing: None on CPU; else enter/exit events and triples
        "ev_enter",
        "ev_exit",
        "dev",
        "dev_lost",
        "peak_bytes",
        "reserved_bytes",
        "deep",
        "has_dl",
    )

    def __init__(self, model_id: int, step: int, t_enter: int) -> None:
        # Only what the host path reads before writing is set here: a step opens
        # on the training thread, where every store counts (about 30 ns each with
        # the step's own work evicting the caches). Device fields are set by
        # Tracer._enter_device; fwd_t0/bwd_end/t_exit are written before any read;
        # the row builder reads peak/reserved bytes with a None default.
        self.model_id = model_id
        self.step = step
        self.t_enter = t_enter
        self.prev: StepRecord | None = None
        self.dl_in = 0
        self.dl_out = 0
        self.h2d = 0
        self.h2d_out = 0
        self.fwd = 0
        self.bwd = 0
        self.opt = 0
        self.fwd_depth = 0
        self.bwd_depth = 0
        self.opt_depth = 0
        self.opt_t0 = 0
        self.comm: list[tuple[int, int]] | None = None
        self.deep: Any = None
        self.has_dl = False

    def init_device(self) -> None:
        """The device-path fields (CUDA events, memory), unset on the host path."""
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
