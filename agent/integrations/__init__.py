"""Callbacks for training frameworks: Hugging Face ``Trainer`` and Lightning.

    from agent.integrations.huggingface import TraceMLCallback
    trainer = Trainer(..., callbacks=[TraceMLCallback()])

    from agent.integrations.lightning import TraceMLCallback
    trainer = lightning.Trainer(..., callbacks=[TraceMLCallback()])

Neither framework is a dependency: importing this package (or either module)
imports no framework; the callback class is built on first access, against
whichever framework is installed. The hook logic lives in plain classes
(``HuggingFaceHooks``, ``LightningHooks``) so it works, and is tested, without
the framework.
"""

from __future__ import annotations

from typing import Any

import agent
from agent.errors import reporter as _reporter


class StepAbandoned(RuntimeError):
    """Handed to a step's ``__exit__`` when its end hook never ran.

    Frameworks skip the end hook when the step raised (and a caller such as
    Hugging Face's ``auto_find_batch_size`` caught it and went on); closing the
    stale step with an exception is what a ``with`` block would have seen.
    """


class StepGuard:
    """At most one open ``agent.trace_step`` per callback, always closed.

    Callbacks split a step into a begin and an end hook, so the context manager
    is entered and exited by hand. A begin while a step is still open (its end
    hook was skipped) closes that one first instead of nesting, and train end
    or shutdown closes whatever is left. Fail-open like the agent itself.
    """

    __slots__ = ("_ctx",)

    def __init__(self) -> None:
        self._ctx: Any = None

    @property
    def open(self) -> bool:
        return self._ctx is not None

    def begin(self, model: Any) -> None:
        if self._ctx is not None:
            self.abandon("a step began before the previous one ended")
        try:
            ctx = agent.trace_step(model)
            ctx.__enter__()
        except Exception as exc:  # agent.trace_step is fail-open; this guards odd models
            _reporter.report("integration", f"trace_step could not start: {exc!r}")
            return
        self._ctx = ctx

    def end(self) -> None:
        self._close(None)

    def abandon(self, why: str) -> None:
        """Close the open step (if any) as failed."""
        if self._ctx is not None:
            self._close(StepAbandoned(why))

    def _close(self, exc: BaseException | None) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is None:
            return
        try:
            if exc is None:
                ctx.__exit__(None, None, None)
            else:
                ctx.__exit__(type(exc), exc, None)
        except Exception as err:
            _reporter.report("integration", f"trace_step could not end: {err!r}")


def numeric_scalars(values: dict[str, Any]) -> dict[str, float]:
    """The int/float entries of a framework's log dict (bools and strings dropped)."""
    out: dict[str, float] = {}
    for key, value in values.items():
        if isinstance(key, str) and isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = float(value)
    return out


__all__ = ["StepAbandoned", "StepGuard", "numeric_scalars"]
