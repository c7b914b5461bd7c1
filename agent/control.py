"""Requests the daemon sends down to this rank (``traceml-daemon profile``), on the sender thread.

The relay passes a ``control`` message down the agent's connection; the sender
hands it here (``agent.sender.Sender._take_controls``). A profile request never
touches torch.profiler on this thread: it sets ``StepProfiler.requested`` (one
attribute store) and raises the step tracer's out-of-line flag, so the training
thread starts the profile itself at its next step enter (``agent.tracer_rare``)
and stops it K steps later at a step enter too; never inside a step.
The trace file is reported like one of ``profile_steps`` (the ``profiles`` table).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from traceml_wire import messages
from traceml_wire.connection_events import Control

SEEN_IDS = 64  # request ids remembered, so a request the relay resent is not run twice


class ControlHandler:
    """One runtime's answer to control requests."""

    def __init__(self, runtime: Any) -> None:
        self._runtime = runtime
        self._seen: deque[str] = deque(maxlen=SEEN_IDS)
        self.profiles_requested = 0

    def __call__(self, control: Control) -> None:
        reporter = self._runtime.reporter
        if control.op != messages.OP_PROFILE:
            reporter.count("control-refused")
            return
        if control.request_id in self._seen:
            return
        self._seen.append(control.request_id)
        profiler = self._profiler()
        if profiler is None:
            return
        if profiler.requested is not None:
            reporter.count("control-busy")  # one request waits at a time; the daemon's CLI says none came
            return
        profiler.requested = control.steps
        self.profiles_requested += 1
        self.keep_armed()

    def keep_armed(self) -> None:
        """While a request waits for its step, the step tracer takes its out-of-line branch.

        Called again every flush: the training thread clears the flag at each step enter
        it finds nothing to do, and could clear it just as this thread set it."""
        profiler = self._runtime.profiler
        tracer = self._runtime._tracer
        if profiler is not None and profiler.requested is not None and tracer is not None:
            tracer._rare = True

    def _profiler(self) -> Any:
        """The runtime's StepProfiler, made (with no listed steps) and armed on first request."""
        runtime = self._runtime
        if runtime.profiler is None:
            from agent import runtime as _runtime_module

            runtime.profiler = runtime._make_profiler()
            if _runtime_module.current is runtime:
                _runtime_module._arm_profiler(runtime.profiler)
        return runtime.profiler
