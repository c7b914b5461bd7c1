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

from agent.capture.record import BACKWARD, PH_BACKWARD, PH_WAIT


def install(tracer: Any) -> Callable[[], None]:
    import torch.autograd

    orig = torch.autograd.backward
    perf = time.perf_counter_ns
    # Fixed for the Tracer's lifetime; on CPU the phase bookkeeping is inline (no calls).
    backend = tracer._backend
    fail = tracer._gate.fail

    def backward(*args: Any, **kwargs: Any) -> Any:
        rec = tracer._active
        if rec is None:
            return orig(*args, **kwargs)
        try:
            depth = rec.bwd_depth + 1
            rec.bwd_depth = depth
            if depth == 1:
                t = perf()
                rec.bwd_end = t  # reused as the start until the outermost backward returns
                if backend is not None:
                    rec.bwd_ev0 = backend.mark()
                tracer._status = (PH_BACKWARD, t, rec.step)
        except Exception as exc:
            fail("backward", exc)
        try:
            return orig(*args, **kwargs)
        finally:
            try:
                depth = rec.bwd_depth
                if depth > 0:
                    rec.bwd_depth = depth - 1
                    if depth == 1:
                        t = perf()
                        rec.bwd += t - rec.bwd_end
                        rec.bwd_end = t
                        if backend is not None:
                            tracer._dev_pair(rec, BACKWARD, rec.bwd_ev0)
                            rec.bwd_ev0 = None
                        tracer._status = (PH_WAIT, t, rec.step)
            except Exception as exc:
                fail("backward", exc)

    backward.__wrapped__ = orig  # type: ignore[attr-defined]
    torch.autograd.backward = backward  # type: ignore[assignment]

    def undo() -> None:
        if torch.autograd.backward is backward:
            torch.autograd.backward = orig  # type: ignore[assignment]

    return undo
