"""Backward time: a wrapper around ``torch.autograd.backward``.

``Tensor.backward`` looks ``torch.autograd.backward`` up at call time, so
patching the module attribute catches both spellings without touching the
autograd engine. Outside a traced step the wrapper is a single attribute
check, so untraced code (evaluation, other libraries) pays almost nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from agent.capture.record import BACKWARD


def install(tracer: Any) -> Callable[[], None]:
    import torch.autograd

    orig = torch.autograd.backward
    perf = time.perf_counter_ns
    # Fixed for the Tracer's lifetime; on CPU the phase bookkeeping is inline (no calls).
    backend = tracer._backend
    fail = tracer._gate.fail

    def backward(*args: Any, **kwargs: Any) -> Any:
        rec = tracer._active
        if rec is None or rec.bwd_depth:
            # Outside a traced step, or a backward inside one (a hook, a double backward):
            # the outermost call times it.
            return orig(*args, **kwargs)
        try:
            # Reused as the start until the backward returns; written before the depth,
            # which is what status() checks first.
            rec.bwd_end = perf()
            if backend is not None:
                rec.bwd_ev0 = backend.mark()
            rec.bwd_depth = 1
        except Exception as exc:
            fail("backward", exc)
        try:
            return orig(*args, **kwargs)
        finally:
            try:
                if rec.bwd_depth:  # 0: the opening above failed
                    t = perf()
                    rec.bwd += t - rec.bwd_end
                    rec.bwd_end = rec.ph_end = t
                    if backend is not None:
                        tracer._dev_pair(rec, BACKWARD, rec.bwd_ev0)
                        rec.bwd_ev0 = None
                    rec.bwd_depth = 0
            except Exception as exc:
                fail("backward", exc)

    backward.__wrapped__ = orig  # type: ignore[attr-defined]
    torch.autograd.backward = backward  # type: ignore[assignment]

    def undo() -> None:
        if torch.autograd.backward is backward:
            torch.autograd.backward = orig  # type: ignore[assignment]

    return undo
