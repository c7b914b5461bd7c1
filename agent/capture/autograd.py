"""Backward time: a wrapper around ``torch.autograd.backward``.

``Tensor.backward`` looks ``torch.autograd.backward`` up at call time, so
patching the module attribute catches both spellings without touching the
autograd engine. Outside a traced step the wrapper is a single attribute
check, so untraced code (evaluation, other libraries) pays almost nothing.

The wrapper takes torch's own parameters by name and passes them on by
position (``KNOWN_PARAMS``): a ``*args, **kwargs`` wrapper would pack and unpack
a tuple and a dict on every call through the interpreter's generic call path,
code the training step never runs, so it costs instruction-cache misses (see
docs/performance.md). A torch whose ``backward`` no longer starts with those parameters
gets the generic form (``_generic``), the same bookkeeping through two helper
calls.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

from agent.capture.record import BACKWARD

# torch.autograd.backward's parameters, in order, and their defaults (unchanged from
# torch 1.x through 2.13): the fast wrapper repeats them, so passing its own defaults
# on by position is passing torch's.
KNOWN_PARAMS = ("tensors", "grad_tensors", "retain_graph", "create_graph", "grad_variables", "inputs")
KNOWN_DEFAULTS = (inspect.Parameter.empty, None, None, False, None, None)


def takes_known_params(fn: Callable[..., Any]) -> bool:
    """Does ``fn`` start with ``KNOWN_PARAMS``, positional-or-keyword, with ``KNOWN_DEFAULTS``?

    Parameters after them are fine: the fast wrapper passes on extra positional and
    keyword arguments as they came (``*more``, ``**named``).
    """
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    head = params[: len(KNOWN_PARAMS)]
    return (
        tuple(p.name for p in head) == KNOWN_PARAMS
        and all(p.kind is p.POSITIONAL_OR_KEYWORD for p in head)
        # None, False and Parameter.empty are singletons: identity is the comparison (a
        # default with its own __eq__, a tensor say, is never called).
        and all(p.default is d for p, d in zip(head, KNOWN_DEFAULTS, strict=True))
    )


def install(tracer: Any) -> Callable[[], None]:
    import torch.autograd

    orig = torch.autograd.backward
    wrapper = _fast(tracer, orig) if takes_known_params(orig) else _generic(tracer, orig)
    wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
    torch.autograd.backward = wrapper  # type: ignore[assignment]

    def undo() -> None:
        if torch.autograd.backward is wrapper:
            torch.autograd.backward = orig  # type: ignore[assignment]

    return undo


def _fast(tracer: Any, orig: Callable[..., Any]) -> Callable[..., Any]:
    """The wrapper for torch's known signature, its bookkeeping inline (the hot path).

    Opens and closes the phase exactly as ``_generic``'s ``opened``/``close`` do (kept
    apart on purpose: two helper calls a step are what this form saves);
    tests/agent/test_capture_autograd.py runs the same tests through both.
    """
    perf = time.perf_counter_ns
    # Fixed for the Tracer's lifetime; on CPU the phase bookkeeping is inline (no calls).
    backend = tracer._backend
    fail = tracer._gate.fail

    def backward(tensors: Any, grad_tensors: Any = None, retain_graph: Any = None, create_graph: Any = False,
                 grad_variables: Any = None, inputs: Any = None, *more: Any, **named: Any) -> Any:
        rec = tracer._active
        if rec is None or rec.bwd_depth:
            # Outside a traced step, or a backward inside one (a hook, a double backward):
            # the outermost call times it.
            return orig(tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs, *more, **named)
        try:
            # Reused as the start until the backward returns; written before the depth,
            # which is what status() checks first.
            rec.bwd_end = perf()
            if backend is not None and rec.sampled:
                rec.bwd_ev0 = backend.mark()
            rec.bwd_depth = 1
        except Exception as exc:
            fail("backward", exc)
        try:
            if more or named:  # parameters a later torch added
                return orig(tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs, *more, **named)
            return orig(tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs)
        finally:
            try:
                if rec.bwd_depth:  # 0: the opening above failed
                    t = perf()
                    rec.bwd += t - rec.bwd_end
                    rec.bwd_end = rec.ph_end = t
                    if backend is not None and rec.sampled:
                        tracer._dev_pair(rec, BACKWARD, rec.bwd_ev0)
                        rec.bwd_ev0 = None
                    rec.bwd_depth = 0
            except Exception as exc:
                fail("backward", exc)

    return backward


def _generic(tracer: Any, orig: Callable[..., Any]) -> Callable[..., Any]:
    """Any signature: arguments passed on as they came; the phase kept by two helpers."""
    perf = time.perf_counter_ns
    backend = tracer._backend
    fail = tracer._gate.fail

    def opened(rec: Any) -> bool:
        try:
            rec.bwd_end = perf()
            if backend is not None and rec.sampled:
                rec.bwd_ev0 = backend.mark()
            rec.bwd_depth = 1
        except Exception as exc:
            fail("backward", exc)
        return bool(rec.bwd_depth)

    def close(rec: Any) -> None:
        try:
            t = perf()
            rec.bwd += t - rec.bwd_end
            rec.bwd_end = rec.ph_end = t
            if backend is not None and rec.sampled:
                tracer._dev_pair(rec, BACKWARD, rec.bwd_ev0)
                rec.bwd_ev0 = None
            rec.bwd_depth = 0
        except Exception as exc:
            fail("backward", exc)

    def backward(*args: Any, **kwargs: Any) -> Any:
        rec = tracer._active
        if rec is None or rec.bwd_depth or not opened(rec):
            return orig(*args, **kwargs)
        try:
            return orig(*args, **kwargs)
        finally:
            close(rec)

    return backward
