"""Optimizer time: torch's global optimizer step pre/post hooks.

Global hooks cover every optimizer, including ones created after install
and ones wrapped by schedulers, without knowing about them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from agent.capture.record import OPTIMIZER


def install(tracer: Any) -> Callable[[], None]:
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    perf = time.perf_counter_ns
    # Fixed for the Tracer's lifetime; on CPU the phase bookkeeping is inline (no calls).
    backend = tracer._backend
    fail = tracer._gate.fail

    def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
        rec = tracer._active
        if rec is None:
            return
        try:
            # A subclass whose step() calls super().step() fires the global hooks twice, nested.
            depth = rec.opt_depth
            if depth == 0:
                rec.opt_t0 = perf()  # before the depth: status() reads the start once depth > 0
                if backend is not None and rec.sampled:
                    rec.opt_ev0 = backend.mark()
            rec.opt_depth = depth + 1
        except Exception as exc:
            fail("optimizer", exc)

    def post(optimizer: Any, args: Any, kwargs: Any) -> None:
        rec = tracer._active
        if rec is None:
            return
        try:
            depth = rec.opt_depth
            if depth <= 0:
                return
            if depth == 1 and rec.opt_t0:
                t = perf()
                rec.opt += t - rec.opt_t0
                rec.opt_t0 = 0
                rec.ph_end = t
                if backend is not None and rec.sampled:
                    tracer._dev_pair(rec, OPTIMIZER, rec.opt_ev0)
                    rec.opt_ev0 = None
            rec.opt_depth = depth - 1
        except Exception as exc:
            fail("optimizer", exc)

    handles = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]

    def undo() -> None:
        for handle in handles:
            handle.remove()

    return undo
