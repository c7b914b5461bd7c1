"""``TraceMLCallback`` for the Hugging Face ``transformers.Trainer``.

    from agent.integrations.huggingface import TraceMLCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[TraceMLCallback()])

Importing this module does not import transformers: ``TraceMLCallback`` is
built (subclassing ``transformers.TrainerCallback``) the first time it is
accessed. One traced step spans ``on_step_begin`` .. ``on_step_end``, that is
one optimizer step including its gradient-accumulation micro-batches.
"""

from __future__ import annotations

from typing import Any

import agent
from agent.integrations import StepGuard, numeric_scalars


class HuggingFaceHooks:
    """The callback's behaviour, independent of transformers.

    ``init_agent`` / ``shutdown_agent`` let a script that already calls
    ``agent.init()`` / ``agent.shutdown()`` itself (to trace evaluation after
    training, say) keep control of the agent's lifetime.
    """

    def __init__(self, *, init_agent: bool = True, shutdown_agent: bool = True, log_metrics: bool = True) -> None:
        self.init_agent = init_agent
        self.shutdown_agent = shutdown_agent
        self.log_metrics = log_metrics
        self._step = StepGuard()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # auto_find_batch_size restarts training after an OOM inside a step.
        self._step.abandon("training restarted inside a step")
        if self.init_agent:
            agent.init()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._step.begin(kwargs.get("model"))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._step.end()

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        if self.log_metrics and logs:
            scalars = numeric_scalars(logs)
            if scalars:
                agent.log(**scalars)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._step.abandon("training ended inside a step")
        if self.shutdown_agent:
            agent.shutdown()


_built: type | None = None


def _build() -> type:
    global _built
    if _built is None:
        from transformers import TrainerCallback  # the only transformers import, deferred

        # HuggingFaceHooks first in the MRO: its methods override the no-op
        # hooks of TrainerCallback; the rest are inherited.
        _built = type("TraceMLCallback", (HuggingFaceHooks, TrainerCallback), {
            "__module__": __name__,
            "__doc__": "TraceML steps, scalars and lifetime for transformers.Trainer (see the module doc).",
        })
    return _built


def __getattr__(name: str) -> Any:
    if name == "TraceMLCallback":
        return _build()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["HuggingFaceHooks"]  # plus TraceMLCallback, built on access
