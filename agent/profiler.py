"""torch.profiler on chosen steps: start at a step boundary, stop after K steps, write the trace.

``StepProfiler`` is the reusable unit: ``start(step, k)`` opens a profile at a
step boundary, ``at_step(index)`` (called as a step is entered) stops it once
``k`` steps have run and writes the Chrome trace file, ``close()`` stops one
still open (shutdown). Every file written is reported through ``on_written``
(rank, first step, steps covered, path) for the ``profiles`` table.

Three triggers use it. A request from the daemon (``traceml-daemon profile``,
``agent.control``): the sender thread sets ``requested`` to K and the next step
enter opens a profile of K steps. Steps traced by ``agent.trace_step``: the step tracer's
out-of-line branch calls ``at_step`` while a listed step is ahead (``armed``),
and only then; with no ``profile_steps`` nothing is armed and a step runs no
profiler code at all. Spans carrying ``enable_profiler=True`` and a listed
``global_step``: ``span_hook`` wraps the span in a profile of its block.
torch is imported only when a profile starts.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from agent.errors import ErrorReporter

_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")

# The profiler of this process while it has listed steps (set by agent.runtime);
# read by the step tracer's out-of-line branch.
active: StepProfiler | None = None


def parse_steps(text: str) -> tuple[int, ...]:
    """``"49,99"`` -> (49, 99); ValueError on anything else."""
    steps = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        value = int(part)
        if value < 0:
            raise ValueError(f"step {value} is negative")
        steps.append(value)
    return tuple(sorted(set(steps)))


class StepProfiler:
    def __init__(self, steps: Iterable[int], out_dir: str, *, label: str, rank: Callable[[], int | None],
                 on_written: Callable[[dict[str, Any]], None], reporter: ErrorReporter, steps_each: int = 1,
                 factory: Callable[[], Any] | None = None) -> None:
        self.pending = set(steps)  # listed steps not profiled yet
        self.out_dir = out_dir
        self.label = _SAFE.sub("_", label)[:80] or "run"
        self.rank = rank
        self.on_written = on_written
        self.reporter = reporter
        self.steps_each = max(1, steps_each)
        self._factory = factory or _torch_profile
        self._lock = threading.Lock()
        self._prof: Any = None
        self._first = 0
        self._stop_at = 0
        self.written: list[str] = []
        # Steps a control request asked for (set by the sender thread, taken at a step enter).
        self.requested: int | None = None

    @property
    def armed(self) -> bool:
        """A listed step is ahead or a profile is open: the step tracer must call ``at_step``."""
        return bool(self.pending) or self._prof is not None or self.requested is not None

    def at_step(self, index: int) -> None:
        """Called as step ``index`` is entered (training thread)."""
        try:
            if self._prof is not None and index >= self._stop_at:
                self.stop()
            requested = self.requested
            if requested is not None and self._prof is None:
                self.requested = None
                self.start(index, requested)
            elif index in self.pending:
                self.start(index, self.steps_each)
            elif self.pending and index > max(self.pending):
                self.pending.clear()  # the listed steps went by (a restart past them)
        except Exception as exc:
            self.reporter.report("profiler", f"torch.profiler on step {index} failed: {exc!r}")

    def start(self, step: int, k: int = 1) -> bool:
        """Open a profile of steps ``step`` .. ``step + k - 1``; False when one is open already."""
        with self._lock:
            self.pending.discard(step)
            if self._prof is not None:
                return False
            prof = self._factory()
            prof.start()
            self._prof, self._first, self._stop_at = prof, step, step + max(1, k)
            return True

    def stop(self) -> str | None:
        """Close the open profile and write its trace; returns the file's path."""
        with self._lock:
            prof, self._prof = self._prof, None
        if prof is None:
            return None
        prof.stop()
        os.makedirs(self.out_dir, exist_ok=True)
        rank = self.rank()
        name = f"{self.label}-rank{'x' if rank is None else rank}-step{self._first}.pt.trace.json"
        path = os.path.abspath(os.path.join(self.out_dir, name))
        prof.export_chrome_trace(path)
        self.written.append(path)
        self.on_written({"step": self._first, "steps": self._stop_at - self._first, "ts": time.time(), "path": path})
        return path

    def close(self) -> None:
        try:
            self.stop()
        except Exception as exc:
            self.reporter.report("profiler", f"could not write the last torch.profiler trace: {exc!r}")

    def span_hook(self, span: Any, args: dict[str, Any]) -> Any:
        """For a span with ``enable_profiler=True``: a profile of its block when its
        ``global_step`` is listed, else the span itself."""
        step = args.get("global_step")
        if not isinstance(step, int) or step not in self.pending:
            return span
        return ProfiledSpan(span, self, step)


class ProfiledSpan:
    """A span whose block is profiled: the profile opens before it and is written after."""

    __slots__ = ("_span", "_prof", "_step", "_started")

    def __init__(self, span: Any, prof: StepProfiler, step: int) -> None:
        self._span = span
        self._prof = prof
        self._step = step
        self._started = False

    def __enter__(self) -> Any:
        try:
            self._started = self._prof.start(self._step)
        except Exception as exc:
            self._prof.reporter.report("profiler", f"torch.profiler for step {self._step} failed: {exc!r}")
        return self._span.__enter__()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        self._span.__exit__(exc_type, exc, tb)
        if self._started:
            self._started = False
            self._prof.close()
        return False

    async def __aenter__(self) -> Any:
        return self.__enter__()

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        return self.__exit__(exc_type, exc, tb)

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return self._span(fn)


def _torch_profile() -> Any:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    return profile(activities=activities)
