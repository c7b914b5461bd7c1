"""Optimizer time: torch's global optimizer step pre/post hooks.

Global hooks cover every optimizer, including ones created after install
and ones wrapped by schedulers, without knowing about them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def install(tracer: Any) -> Callable[[], None]:
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
        rec = tracer._active
        if rec is not None:
            tracer._opt_pre(rec)

    def post(optimizer: Any, args: Any, kwargs: Any) -> None:
        rec = tracer._active
        if rec is not None:
            tracer._opt_post(rec)

    handles = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]

    def undo() -> None:
        for handle in handles:
            handle.remove()

    return undo
