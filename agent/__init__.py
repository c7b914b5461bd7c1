"""TraceML agent: step-level telemetry from inside a PyTorch training process.

    import agent
    agent.init()
    for batch in loader:
        with agent.trace_step(model):
            ...
        agent.log(loss=loss)
    agent.shutdown()

Every function here is fail-open: it never raises into the training script
and never blocks on the network. ``TRACEML_DISABLE=1`` turns all of them into
cheap no-ops. Importing this package imports neither torch nor the daemon's
UI/storage stack; ``init()`` imports no torch either: the tracer (which does)
is built on the agent's background thread. Without torch installed (the
head node's install, no ``traceml-daemon[agent]`` extra) ``init()`` says so in
one ``[traceml]`` line and every function stays a no-op.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from agent import runtime as _rt
from agent import sessions as _sessions
from agent import spans as _spans
from agent.errors import reporter as _reporter

__all__ = [
    "init", "trace_step", "log", "span", "instant", "shutdown",
    "trace_perf", "set_task_id", "session_context", "trace_session", "trace_session_phase",
    "trace_session_event", "current_task_id", "current_session_id", "CATEGORIES",
]

_NULL = _rt.NULL_CONTEXT


def init(**overrides: Any) -> None:
    """Start the agent (idempotent). Reads the environment; never raises.

    Connecting to the relay happens on the background sender thread, so this
    returns at once even when nothing is listening.
    """
    try:
        _rt.init(overrides)
    except Exception as exc:  # fail-open: a telemetry bug must not stop training
        _reporter.report("init", f"agent disabled after an internal error: {exc!r}")


def trace_step(model: Any = None) -> AbstractContextManager[None]:
    """Context manager around one training step of ``model``."""
    try:
        # The hot path: the model's reusable step context, looked up inline (see
        # agent.runtime.fast_models); ids are reused after a model dies, hence ref().
        models = _rt.fast_models
        if models is not None:
            ctx = models.get(id(model))
            if ctx is not None and ctx.ref() is model:
                return ctx
        return _rt.step_context(model)
    except Exception as exc:
        _reporter.report("trace_step", f"trace_step failed: {exc!r}")
        return _NULL


def log(**scalars: Any) -> None:
    """Per-step scalars (floats or tensors, resolved lazily off the training thread)."""
    try:
        runtime = _rt.current or _rt.implicit()
        if runtime is not None and runtime.tracer is not None:
            runtime.tracer.log(**scalars)
    except Exception as exc:
        _reporter.report("log", f"log failed: {exc!r}")


def span(name: str, category: str | None = None, **args: Any) -> Any:
    """A named region: ``with``, ``async with`` or a decorator (agent/spans.py)."""
    try:
        return _spans.open_span(name, category, args)
    except Exception as exc:
        _reporter.report("span", f"span failed: {exc!r}")
        return _spans.NULL_SPAN


def instant(name: str, category: str | None = None, **args: Any) -> None:
    """A point-in-time mark."""
    try:
        _spans.instant(name, category, args)
    except Exception as exc:
        _reporter.report("instant", f"instant failed: {exc!r}")


# Decorators and the rollout session lifecycle (agent/spans.py, agent/sessions.py):
# each is fail-open on its own.
trace_perf = _spans.trace_perf
CATEGORIES = _spans.CATEGORIES
set_task_id = _sessions.set_task_id
current_task_id = _sessions.current_task_id
current_session_id = _sessions.current_session_id
session_context = _sessions.session_context
trace_session = _sessions.trace_session
trace_session_phase = _sessions.trace_session_phase


def trace_session_event(event: str, session_id: int | None = None, task_id: int | None = None,
                        **payload: Any) -> None:
    """``mark_finalized`` (status accepted|rejected|failed|dropped, optional reason) or
    ``mark_<phase>_start|end``, for ``session_id``, every session of ``task_id``, or this context's."""
    try:
        _sessions.trace_session_event(event, session_id=session_id, task_id=task_id, **payload)
    except Exception as exc:
        _reporter.report("session-event", f"trace_session_event failed: {exc!r}")


def shutdown() -> None:
    """Flush and stop (bounded wait, about 2 s at most). Also runs at exit."""
    try:
        _rt.shutdown()
    except Exception as exc:
        _reporter.report("shutdown", f"shutdown failed: {exc!r}")
