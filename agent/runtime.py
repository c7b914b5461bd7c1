"""The agent's process-wide lifecycle: init, the hot-path entry, shutdown, fork.

One Runtime per process (agent.rank_runtime), created by ``init()`` (explicitly
or by the first trace_step/log/span), stopped by ``shutdown()`` or at exit and
forgotten in a forked child. Everything here is fail-open: failures are
reported once on stderr and the training continues.

The hot path, ``agent.trace_step(model)``, skips this module once the runtime
is settled: ``fast_models`` publishes the tracer's id(model) -> step context
map, and ``agent.trace_step`` looks the model up there itself (one dict
lookup and one weakref call per step, no call into the runtime).
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

from agent import sessions as _sessions
from agent import spans as _spans
from agent.config import load_config
from agent.errors import reporter
from agent.node_relay import RelayStarter
from agent.rank_runtime import NULL_CONTEXT, Runtime
from agent.tracer_build import NO_TORCH_MESSAGE, TracerFactory, torch_installed

_lock = threading.Lock()
current: Runtime | None = None  # read without the lock on the hot path
# The current runtime's Tracer.models once it is settled and fail-open, else None; read
# without the lock by agent.trace_step, written under it (publish, shutdown, fork).
fast_models: dict[int, Any] | None = None
disabled = False
_initialized = False  # init ran (or was attempted) in this process
_forked_child = False
_atexit_registered = False


def init(
    overrides: Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    tracer_factory: Callable[[], TracerFactory] | None = None,
    relay_starter: Callable[[], RelayStarter] | None = None,
) -> Runtime | None:
    """Create and start the runtime once; later calls return the existing one."""
    global current, disabled, _initialized, _forked_child, _atexit_registered
    with _lock:
        _forked_child = False  # an explicit init() in a forked child re-arms it
        if current is not None or (disabled and _initialized):
            if overrides:
                reporter.report("init-twice", "agent.init() already ran; ignoring the new arguments")
            return current
        _initialized = True
        config, problems = load_config(os.environ if env is None else env, overrides)
        for problem in problems:
            reporter.report(f"config:{problem}", problem)
        if config.disabled:
            disabled = True
            return None
        if tracer_factory is None and not torch_installed():
            # A sender without a tracer would only ship resource samples under a rank's name:
            # off, said once, so a missing extra is not mistaken for a silent run.
            reporter.report("no-torch", NO_TORCH_MESSAGE)
            disabled = True
            return None
        disabled = False
        runtime = Runtime(config, env=env, tracer_factory=tracer_factory, relay_starter=relay_starter)
        runtime.start()
        current = runtime
        _arm_profiler(runtime.profiler)
        if not _atexit_registered:
            atexit.register(_at_exit)
            _atexit_registered = True
        return runtime


def step_context(model: Any) -> Any:
    """agent.trace_step when its lookup in ``fast_models`` missed: init, settle, a new model."""
    runtime = current or implicit()
    if runtime is None:
        return NULL_CONTEXT
    ctx = runtime.trace_step(model)
    if runtime._fail_open and runtime._settled:
        _publish(runtime)
    return ctx


def _publish(runtime: Runtime) -> None:
    global fast_models
    models = getattr(runtime._tracer, "models", None)
    if not isinstance(models, dict):
        return
    with _lock:
        if current is runtime:  # not shut down (or forked) meanwhile
            fast_models = models


def implicit() -> Runtime | None:
    """The runtime for a call made before init(): init once, never after shutdown."""
    if disabled or _forked_child or _initialized:
        return current
    return init()


def shutdown(timeout: float | None = None) -> None:
    global current, fast_models
    with _lock:
        runtime, current = current, None
        fast_models = None
        _arm_profiler(None)
    if runtime is not None:
        runtime.stop(runtime.config.shutdown_timeout_s if timeout is None else timeout)


def _at_exit() -> None:
    try:
        shutdown()
    except BaseException:  # never change the exit status of the training script
        pass


def _after_fork_in_child() -> None:
    """DataLoader workers and other forks: no sender, no relay, calls no-op.

    The parent's sender thread does not exist here and its locks may have
    been held at fork time, so the child forgets everything instead of
    trying to shut it down.
    """
    global _lock, current, _forked_child, fast_models
    _lock = threading.Lock()
    current = None
    fast_models = None
    _forked_child = True
    _arm_profiler(None)
    reporter.after_fork()


def _arm_profiler(profiler: Any) -> None:
    """Hand the step tracer and spans their profiler (None: no profile_steps, or gone)."""
    from agent import profiler as _profiler

    _profiler.active = profiler
    _spans.profiled_span = None if profiler is None else profiler.span_hook


def _current_spans() -> _spans.SpanSink | None:
    runtime = current or implicit()
    return None if runtime is None else runtime.spans


def _current_sessions() -> _sessions.SessionBook | None:
    runtime = current or implicit()
    return None if runtime is None else runtime.sessions


_spans.resolve_sink = _current_spans
_sessions.resolve_book = _current_sessions


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
