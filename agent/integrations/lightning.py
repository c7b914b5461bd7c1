"""``TraceMLCallback`` for Lightning (``lightning.pytorch`` or ``pytorch_lightning``).

    from agent.integrations.lightning import TraceMLCallback
    trainer = lightning.Trainer(..., callbacks=[TraceMLCallback()])

Importing this module imports neither package: the class is built on first
access, on ``lightning.pytorch.Callback`` when the unified ``lightning``
package is installed, else on ``pytorch_lightning.Callback`` (a Trainer only
accepts callbacks of its own package; ``callback_class("pytorch_lightning")``
picks one explicitly). One traced step spans ``on_train_batch_start`` ..
``on_train_batch_end``.
"""

from __future__ import annotations

import importlib
from typing import Any

import agent
from agent.integrations import StepGuard

PACKAGES = ("lightning.pytorch", "pytorch_lightning")


class LightningHooks:
    """The callback's behaviour, independent of Lightning."""

    def __init__(self, *, init_agent: bool = True, shutdown_agent: bool = True, log_loss: bool = True) -> None:
        self.init_agent = init_agent
        self.shutdown_agent = shutdown_agent
        self.log_loss = log_loss
        self._step = StepGuard()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # Lightning has set up the process group by now, so identity is final.
        if self.init_agent:
            agent.init()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._step.begin(pl_module)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._step.end()
        if self.log_loss:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            # A tensor is fine: agent.log resolves it lazily, off the training thread.
            if loss is not None and (hasattr(loss, "detach") or isinstance(loss, float)):
                agent.log(loss=loss.detach() if hasattr(loss, "detach") else loss)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._step.abandon(f"training raised {type(exception).__name__}")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._step.abandon("training ended inside a step")
        if self.shutdown_agent:
            agent.shutdown()


_built: dict[str, type] = {}


def callback_class(package: str | None = None) -> type:
    """The callback class for ``package`` (default: the first of PACKAGES installed)."""
    candidates = (package,) if package else PACKAGES
    last: ImportError | None = None
    for name in candidates:
        if name in _built:
            return _built[name]
        try:
            base = importlib.import_module(name).Callback
        except ImportError as exc:
            last = exc
            continue
        _built[name] = type("TraceMLCallback", (LightningHooks, base), {
            "__module__": __name__,
            "__doc__": f"TraceML steps and lifetime for {name}.Trainer (see the module doc).",
        })
        return _built[name]
    raise ImportError(f"TraceMLCallback needs one of {', '.join(candidates)} installed") from last


def __getattr__(name: str) -> Any:
    if name == "TraceMLCallback":
        return callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["LightningHooks", "callback_class"]  # plus TraceMLCallback, built on access
