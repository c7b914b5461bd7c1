"""Backward time: a wrapper around ``torch.autograd.backward``.

``Tensor.backward`` looks ``torch.autograd.backward`` up at call time, so
patching the module attribute catches both spellings without touching the
autograd engine. Outside a traced step the wrapper is a single attribute
check, so untraced code (evaluation, other libraries) pays almost nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def install(tracer: Any) -> Callable[[], None]:
    import torch.autograd

    orig = torch.autograd.backward

    def backward(*args: Any, **kwargs: Any) -> Any:
        rec = tracer._active
        if rec is None:
            return orig(*args, **kwargs)
        tracer._bwd_begin(rec)
        try:
            return orig(*args, **kwargs)
        finally:
            tracer._bwd_end(rec)

    backward.__wrapped__ = orig  # type: ignore[attr-defined]
    torch.autograd.backward = backward  # type: ignore[assignment]

    def undo() -> None:
        if torch.autograd.backward is backward:
            torch.autograd.backward = orig  # type: ignore[assignment]

    return undo
