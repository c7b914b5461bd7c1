"""User spans and instants: ``with``, ``async with`` and decorators, nested per lane.

A lane is where code runs: an asyncio task, or a thread outside any task. The
enclosing span is kept in a context variable, so spans opened by concurrent
tasks nest inside their own task only: a span whose context holds another
lane's span (a task created inside a span, ``asyncio.to_thread``) starts at the
top of its own lane. Threads start with an empty context and land on their own
lane.

The calling thread only stamps the clock and appends a tuple to a bounded
deque; names, JSON args and wall times are made on the sender thread at flush
(``SpanSink.take``), where the deque is drained into the ``spans`` table.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import json
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from agent.errors import ErrorReporter

# Predefined categories; any other string works too.
COMPUTE = "compute"
COMM = "comm"
IO = "io"
SCHEDULER = "scheduler"
INSTR = "instr"
CATEGORIES = (COMPUTE, COMM, IO, SCHEDULER, INSTR)

# A span row waiting for the flush, about this many bytes (the tuple and its ints).
ROW_BYTES = 200
MAX_ARGS_CHARS = 4096  # a span's JSON args are cut here
MAX_THREAD_NAMES = 4096

_perf = time.perf_counter_ns
_get_ident = threading.get_ident

# (span id, lane key) of the innermost open span in this context.
_CURRENT: ContextVar[tuple[int, Any] | None] = ContextVar("traceml_span", default=None)

# The runtime that owns the sink, resolved per call (set by agent.runtime at import):
# returns the current sink, initializing the agent implicitly, or None when off.
resolve_sink: Callable[[], SpanSink | None] = lambda: None  # noqa: E731


def _bind_asyncio() -> None:
    """Use asyncio's C helpers once asyncio is imported: before that no loop can run,
    and ``import agent`` must not import it."""
    global _get_running_loop, _current_task
    if "asyncio" in sys.modules:
        from asyncio import current_task
        from asyncio.events import _get_running_loop as running_loop

        _get_running_loop = running_loop
        _current_task = current_task


def _unbound_running_loop() -> Any:
    _bind_asyncio()
    return None if _get_running_loop is _unbound_running_loop else _get_running_loop()


_get_running_loop: Callable[[], Any] = _unbound_running_loop
_current_task: Callable[[Any], Any] = lambda loop: None  # noqa: E731


class SpanSink:
    """Finished spans of one process, waiting for the sender thread (bounded, drop oldest)."""

    def __init__(self, max_bytes: int, reporter: ErrorReporter) -> None:
        self.max_rows = max(1024, max_bytes // ROW_BYTES)
        self.rows: deque[tuple[Any, ...]] = deque(maxlen=self.max_rows)
        self.ids = itertools.count(1)
        self.reporter = reporter
        self.tracer: Any = None  # the step tracer once built: spans carry its step
        self.dropped = 0
        self.wall_offset_ns = time.time_ns() - _perf()
        # Thread names by ident, taken when a thread first records (it may be gone by the flush).
        self.threads: dict[int, str] = {}

    def name_thread(self, ident: int) -> None:
        if len(self.threads) >= MAX_THREAD_NAMES:
            self.threads.clear()
        self.threads[ident] = threading.current_thread().name

    def step(self) -> int | None:
        tracer = self.tracer
        if tracer is None:
            return None
        rec = tracer._active
        if rec is None:
            rec = tracer._last
        return rec.step if rec is not None else None

    def add(self, row: tuple[Any, ...]) -> None:
        rows = self.rows
        if len(rows) >= self.max_rows:
            self.dropped += 1  # the deque's maxlen drops the oldest as this one goes in
        rows.append(row)

    def fail(self, kind: str, exc: BaseException) -> None:
        self.reporter.report(f"span:{kind}", f"span {kind} failed: {exc!r}")

    def take(self) -> dict[str, list[Any]] | None:
        """Every buffered span as the columns of the ``spans`` table (sender thread)."""
        rows = self.rows
        if not rows:
            return None
        names = self.threads
        offset = self.wall_offset_ns
        cols: dict[str, list[Any]] = {
            c: [] for c in ("name", "start_ns", "dur_ns", "step", "args", "category", "lane", "span_id", "parent_id")
        }
        while True:
            try:
                name, category, args, t0, dur, ident, task, span_id, parent, step = rows.popleft()
            except IndexError:
                break
            cols["name"].append(name)
            cols["start_ns"].append(t0 + offset)
            cols["dur_ns"].append(dur)
            cols["step"].append(step)
            cols["args"].append(_json(args))
            cols["category"].append(category)
            cols["lane"].append(f"task:{task}" if task is not None else f"thread:{names.get(ident, ident)}")
            cols["span_id"].append(span_id)
            cols["parent_id"].append(parent)
        return cols


def _json(args: dict[str, Any] | None) -> str:
    if not args:
        return "{}"
    try:
        text = json.dumps(args, default=str)
    except Exception as exc:  # a key that is not a string, a recursive structure
        text = json.dumps({"unserializable": repr(exc)})
    return text if len(text) <= MAX_ARGS_CHARS else json.dumps({"truncated": text[: MAX_ARGS_CHARS - 64]})


def lane_key() -> tuple[Any, str | None]:
    """(the lane's key, its task name or None): the current task, else the thread."""
    loop = _get_running_loop()
    task = _current_task(loop) if loop is not None else None
    if task is None:
        return _get_ident(), None
    return task, task.get_name()


class Span:
    """One region: a context manager (sync and async) and a decorator."""

    __slots__ = ("_sink", "name", "category", "args", "_t0", "_token", "_id", "_parent", "_task", "_step", "_deco")

    def __init__(self, sink: SpanSink, name: str, category: str | None, args: dict[str, Any]) -> None:
        self._sink = sink
        self.name = name
        self.category = category
        self.args = args
        self._token: Any = None

    def __enter__(self) -> Span:
        try:
            sink = self._sink
            loop = _get_running_loop()
            task = _current_task(loop) if loop is not None else None
            lane = _get_ident() if task is None else task
            cur = _CURRENT.get()
            span_id = next(sink.ids)
            self._id = span_id
            self._parent = cur[0] if cur is not None and cur[1] == lane else None
            self._task = None if task is None else task.get_name()
            self._step = sink.step() if sink.tracer is not None else None
            self._token = _CURRENT.set((span_id, lane))
            self._t0 = _perf()
        except Exception as exc:
            self._token = None
            self._sink.fail("enter", exc)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        t1 = _perf()
        token = self._token
        if token is None:
            return False
        self._token = None
        try:
            _CURRENT.reset(token)
        except Exception:  # exited in another context than it entered: keep the span, not the nesting
            pass
        try:
            args = self.args
            if exc_type is not None:
                args = {**args, "exception": f"{exc_type.__name__}: {str(exc)[:200]}"}
            sink = self._sink
            ident = _get_ident()
            if ident not in sink.threads:
                sink.name_thread(ident)
            sink.add((self.name, self.category, args, self._t0, t1 - self._t0, ident, self._task, self._id,
                      self._parent, self._step))
        except Exception as err:
            self._sink.fail("exit", err)
        return False

    async def __aenter__(self) -> Span:
        return self.__enter__()

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        return self.__exit__(exc_type, exc, tb)

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        # A decorator opens a span per call with the args as given (enable_profiler kept).
        return decorate(fn, self.name, self.category, getattr(self, "_deco", None) or self.args)


class NullSpan:
    """The span of an agent that is off: the block runs, nothing is recorded."""

    __slots__ = ("name", "category", "args")

    def __init__(self, name: str = "", category: str | None = None, args: dict[str, Any] | None = None) -> None:
        self.name = name
        self.category = category
        self.args = args or {}

    def __enter__(self) -> NullSpan:
        return self

    def __exit__(self, *exc: object) -> bool:
        return False

    async def __aenter__(self) -> NullSpan:
        return self

    async def __aexit__(self, *exc: object) -> bool:
        return False

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return decorate(fn, self.name, self.category, self.args)


NULL_SPAN = NullSpan()

# A span with enable_profiler=True asks this hook (agent.profiler) for a wrapper when
# its global_step is listed; None while no profile_steps are configured.
profiled_span: Callable[[Any, dict[str, Any]], Any] | None = None


def open_span(name: str, category: str | None, args: dict[str, Any]) -> Any:
    sink = resolve_sink()
    if sink is None:
        return NullSpan(name, category, args)
    if args and "enable_profiler" in args:
        return _with_profiler(Span(sink, str(name), category, args), args)
    return Span(sink, str(name), category, args)


def _with_profiler(span: Span, args: dict[str, Any]) -> Any:
    span._deco = args
    args = dict(args)
    wanted = bool(args.pop("enable_profiler"))
    span.args = args
    hook = profiled_span
    if not wanted or hook is None:
        return span
    return hook(span, args)


def instant(name: str, category: str | None, args: dict[str, Any]) -> None:
    sink = resolve_sink()
    if sink is None:
        return
    try:
        t = _perf()
        lane, task = lane_key()
        cur = _CURRENT.get()
        parent = cur[0] if cur is not None and cur[1] == lane else None
        step = sink.step() if sink.tracer is not None else None
        ident = _get_ident()
        if ident not in sink.threads:
            sink.name_thread(ident)
        sink.add((str(name), category, args, t, None, ident, task, next(sink.ids), parent, step))
    except Exception as exc:
        sink.fail("instant", exc)


def decorate(fn: Callable[..., Any], name: str, category: str | None, args: dict[str, Any]) -> Callable[..., Any]:
    """Wrap ``fn`` (sync or async) in a fresh span per call; its exception is recorded
    on the span and propagates unchanged."""
    label = name or getattr(fn, "__qualname__", repr(fn))
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(*a: Any, **kw: Any) -> Any:
            async with open_span(label, category, args):
                return await fn(*a, **kw)

        return async_wrapper

    @functools.wraps(fn)
    def wrapper(*a: Any, **kw: Any) -> Any:
        with open_span(label, category, args):
            return fn(*a, **kw)

    return wrapper


def trace_perf(name: str, category: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: one span per call of a sync or async function."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        return decorate(fn, name, category, {})

    return wrap
