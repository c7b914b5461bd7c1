"""Rollout tasks and sessions: the lifecycle of each generated sample.

A task is one data point (``set_task_id``); a session is one sample of it
(``session_context``), which runs phases (generate, reward, toolcall, any
name) and ends with ``mark_finalized`` and a status. Both ids live in context
variables, so concurrent asyncio tasks each see their own.

The calling thread only updates the open session and appends a tuple to a
bounded deque, twice a session: when it is registered (so a pending session is
seen live, with its age) and when it is finalized, carrying its phase
executions. The sender thread turns the tuples into the ``rollout_sessions``
and ``session_phases`` tables at flush (``SessionBook.take``). Open sessions are
bounded too: past ``max_open`` a new session is not tracked and is counted.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import json
import re
import time
from collections import deque
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from agent.errors import ErrorReporter

STATUSES = ("accepted", "rejected", "failed", "dropped")
PENDING = "pending"
MAX_PAYLOAD_CHARS = 4096
MAX_TEXT = 256  # status, reason and phase names are cut here
EVENT_BYTES = 320  # one queued event, about (the tuple, its ints, a session's phase tuples)
DEFAULT_MAX_OPEN = 1 << 18

_perf = time.perf_counter_ns
_MARK = re.compile(r"^mark_(.+)_(start|end)$")

_TASK: ContextVar[int | None] = ContextVar("traceml_task", default=None)
_SESSION: ContextVar[int | None] = ContextVar("traceml_session", default=None)

# Set by agent.runtime at import: the current book, initializing the agent implicitly.
resolve_book: Callable[[], SessionBook | None] = lambda: None  # noqa: E731

# Event kinds in the queue: a session registered, a session finalized (with its phases).
_SUBMIT = 0
_FINAL = 2


class _Session:
    __slots__ = ("task_id", "submit", "open", "done")

    def __init__(self, task_id: int, submit: int) -> None:
        self.task_id = task_id
        self.submit = submit
        self.open: list[_Exec] = []  # phase executions started and not ended
        # Ended executions (phase, start, end, start payload, end payload): they travel with
        # the finalization, one queued event a session instead of one a phase.
        self.done: list[tuple[Any, ...]] = []


class _Exec:
    __slots__ = ("phase", "start", "payload")

    def __init__(self, phase: str, start: int, payload: dict[str, Any] | None) -> None:
        self.phase = phase
        self.start = start
        self.payload = payload


class SessionBook:
    """The open sessions of one process and the events waiting for the flush."""

    def __init__(self, max_bytes: int, reporter: ErrorReporter, max_open: int = DEFAULT_MAX_OPEN) -> None:
        self.max_events = max(1024, max_bytes // EVENT_BYTES)
        self.events: deque[tuple[Any, ...]] = deque(maxlen=self.max_events)
        self.max_open = max_open
        self.sessions: dict[int, _Session] = {}
        self.tasks: dict[int, list[int]] = {}
        self.session_ids = itertools.count(1)
        self.task_ids = itertools.count(1)
        self.reporter = reporter
        self.wall_offset_ns = time.time_ns() - _perf()
        # Loss counters, for the "drops" table.
        self.events_dropped = 0
        self.sessions_untracked = 0  # registered past max_open
        self.phases_unended = 0  # closed by finalization with no end
        self.phases_orphaned = 0  # a phase outside any open session
        self.sessions_registered = 0
        self.sessions_finalized = 0

    def counters(self) -> dict[str, int]:
        return {
            "session_events_dropped": self.events_dropped,
            "sessions_untracked": self.sessions_untracked,
            "session_phases_unended": self.phases_unended,
            "session_phases_orphaned": self.phases_orphaned,
        }

    def _add(self, event: tuple[Any, ...]) -> None:
        events = self.events
        if len(events) >= self.max_events:
            self.events_dropped += 1  # maxlen drops the oldest
        events.append(event)

    def fail(self, kind: str, exc: BaseException) -> None:
        self.reporter.report(f"session:{kind}", f"session tracing ({kind}) failed: {exc!r}")

    # ------------------------------------------------------------ lifecycle

    def new_task(self) -> int:
        return next(self.task_ids)

    def register(self, task_id: int) -> int:
        sid = next(self.session_ids)
        self.sessions_registered += 1
        if len(self.sessions) >= self.max_open:
            self.sessions_untracked += 1
            return sid
        now = _perf()
        self.sessions[sid] = _Session(task_id, now)
        members = self.tasks.get(task_id)
        if members is None:
            self.tasks[task_id] = [sid]
        else:
            members.append(sid)
        self._add((_SUBMIT, sid, task_id, now))
        return sid

    def phase_start(self, sid: int | None, phase: str, payload: dict[str, Any] | None) -> _Exec | None:
        sess = self.sessions.get(sid) if sid is not None else None  # type: ignore[arg-type]
        if sess is None:
            self.phases_orphaned += 1
            return None
        ex = _Exec(phase, _perf(), payload)
        sess.open.append(ex)
        return ex

    def phase_end(self, sid: int, ex: _Exec, payload: dict[str, Any] | None) -> None:
        end = _perf()
        sess = self.sessions.get(sid)
        if sess is None:
            return  # finalized meanwhile: already sent with no end
        try:
            sess.open.remove(ex)
        except ValueError:
            return
        sess.done.append((ex.phase, ex.start, end, ex.payload, payload))

    def phase_end_by_name(self, sid: int, phase: str, payload: dict[str, Any] | None) -> None:
        sess = self.sessions.get(sid)
        if sess is None:
            self.phases_orphaned += 1
            return
        for ex in reversed(sess.open):
            if ex.phase == phase:
                self.phase_end(sid, ex, payload)
                return
        self.phases_orphaned += 1

    def finalize(self, sid: int, status: str, reason: str | None) -> bool:
        sess = self.sessions.pop(sid, None)
        if sess is None:
            return False
        now = _perf()
        members = self.tasks.get(sess.task_id)
        if members is not None:
            try:
                members.remove(sid)
            except ValueError:
                pass
            if not members:
                self.tasks.pop(sess.task_id, None)
        unended = len(sess.open)
        phases = sess.done
        for ex in sess.open:
            phases.append((ex.phase, ex.start, None, ex.payload, None))
        self.phases_unended += unended
        self.sessions_finalized += 1
        self._add((_FINAL, sid, sess.task_id, sess.submit, now, status, reason, unended, phases))
        return True

    def finalize_task(self, task_id: int, status: str, reason: str | None) -> int:
        done = 0
        for sid in list(self.tasks.get(task_id, ())):
            done += self.finalize(sid, status, reason)
        return done

    # ------------------------------------------------------------ flush

    def take(self) -> dict[str, dict[str, list[Any]]]:
        """The queued events as ``rollout_sessions`` and ``session_phases`` columns (sender thread)."""
        events = []
        pop = self.events.popleft
        while True:
            try:
                events.append(pop())
            except IndexError:
                break
        if not events:
            return {}
        offset = self.wall_offset_ns
        finals = {e[1] for e in events if e[0] == _FINAL}
        sess: dict[str, list[Any]] = {
            c: [] for c in ("task_id", "session_id", "status", "reason", "submit_ts", "finalized_ts", "open_phases")
        }
        phases: dict[str, list[Any]] = {
            c: [] for c in ("session_id", "phase", "start_ts", "end_ts", "start_payload", "end_payload")
        }
        for e in events:
            if e[0] == _SUBMIT:
                _, sid, task, submit = e
                if sid in finals:
                    continue  # finalized before this flush: its final row says it all
                status, reason, final, unended = PENDING, None, None, None
            else:
                _, sid, task, submit, final, status, reason, unended, done = e
                for phase, start, end, p0, p1 in done:
                    phases["session_id"].append(sid)
                    phases["phase"].append(phase)
                    phases["start_ts"].append((start + offset) / 1e9)
                    phases["end_ts"].append(None if end is None else (end + offset) / 1e9)
                    phases["start_payload"].append(_json(p0))
                    phases["end_payload"].append(_json(p1))
            sess["task_id"].append(task)
            sess["session_id"].append(sid)
            sess["status"].append(status)
            sess["reason"].append(reason)
            sess["submit_ts"].append((submit + offset) / 1e9)
            sess["finalized_ts"].append(None if final is None else (final + offset) / 1e9)
            sess["open_phases"].append(unended)
        out = {}
        if sess["session_id"]:
            out["rollout_sessions"] = sess
        if phases["session_id"]:
            out["session_phases"] = phases
        return out


def _json(payload: dict[str, Any] | None) -> str | None:
    if not payload:
        return None
    try:
        text = json.dumps(payload, default=str)
    except Exception as exc:
        text = json.dumps({"unserializable": repr(exc)})
    return text if len(text) <= MAX_PAYLOAD_CHARS else json.dumps({"truncated": text[: MAX_PAYLOAD_CHARS - 64]})


def _text(value: Any) -> str | None:
    return None if value is None else str(value)[:MAX_TEXT]


# ---------------------------------------------------------------- public calls


def set_task_id(task_id: int | None = None) -> int:
    """Make ``task_id`` (or a new id) the current task of this context; returns it."""
    try:
        return _set_task_id(task_id)
    except Exception as exc:
        _report("task", exc)
        return task_id if isinstance(task_id, int) else 0


def _set_task_id(task_id: Any) -> int:
    book = resolve_book()
    if task_id is None:
        task_id = book.new_task() if book is not None else 0
    elif not isinstance(task_id, int) or isinstance(task_id, bool):
        if book is not None:
            book.reporter.report("session:task_id", f"set_task_id needs an int, got {type(task_id).__name__}; "
                                 "a new id is used")
            task_id = book.new_task()
        else:
            task_id = 0
    _TASK.set(task_id)
    return task_id


def current_task_id() -> int | None:
    return _TASK.get()


def current_session_id() -> int | None:
    return _SESSION.get()


def _enter_session(book: SessionBook) -> tuple[Any, Any]:
    task = _TASK.get()
    task_token = None
    if task is None:
        task = book.new_task()
        task_token = _TASK.set(task)
    sid = book.register(task)
    return task_token, _SESSION.set(sid)


def _leave_session(tokens: tuple[Any, Any]) -> None:
    task_token, session_token = tokens
    try:
        _SESSION.reset(session_token)
        if task_token is not None:
            _TASK.reset(task_token)
    except Exception:  # left in another context than entered
        pass


def session_context() -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: each call registers a new session under the current task (a new task
    when there is none) and runs with both ids in context."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*a: Any, **kw: Any) -> Any:
                tokens = _open_session()
                try:
                    return await fn(*a, **kw)
                finally:
                    if tokens is not None:
                        _leave_session(tokens)

            return async_wrapper

        @functools.wraps(fn)
        def wrapper(*a: Any, **kw: Any) -> Any:
            tokens = _open_session()
            try:
                return fn(*a, **kw)
            finally:
                if tokens is not None:
                    _leave_session(tokens)

        return wrapper

    return wrap


def _open_session() -> tuple[Any, Any] | None:
    try:
        book = resolve_book()
        if book is None:
            return None
        return _enter_session(book)
    except Exception as exc:
        _report("register", exc)
        return None


def _report(kind: str, exc: BaseException) -> None:
    from agent.errors import reporter

    reporter.report(f"session:{kind}", f"session tracing ({kind}) failed: {exc!r}")


class Phase:
    """One execution of a session phase: a sync and async context manager."""

    __slots__ = ("_book", "phase", "start_payload", "end_payload", "_sid", "_ex")

    def __init__(self, book: SessionBook | None, phase: str, start_payload: dict[str, Any] | None,
                 end_payload: dict[str, Any] | None) -> None:
        self._book = book
        self.phase = phase
        self.start_payload = start_payload
        self.end_payload = end_payload
        self._ex: _Exec | None = None

    def __enter__(self) -> Phase:
        book = self._book
        if book is not None:
            try:
                sid = _SESSION.get()
                self._sid = sid
                self._ex = book.phase_start(sid, self.phase, self.start_payload)
            except Exception as exc:
                book.fail("phase", exc)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        ex = self._ex
        if ex is not None:
            self._ex = None
            try:
                payload = self.end_payload
                if exc_type is not None:
                    payload = {**(payload or {}), "exception": f"{exc_type.__name__}: {str(exc)[:200]}"}
                book = self._book
                assert book is not None  # an _Exec comes from a book
                book.phase_end(self._sid, ex, payload)
            except Exception as err:
                _report("phase", err)
        return False

    async def __aenter__(self) -> Phase:
        return self.__enter__()

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        return self.__exit__(exc_type, exc, tb)


def trace_session_phase(phase: str, start_payload: dict[str, Any] | None = None,
                        end_payload: dict[str, Any] | None = None) -> Phase:
    try:
        book = resolve_book()
    except Exception as exc:
        _report("phase", exc)
        book = None
    return Phase(book, _text(phase) or "", start_payload, end_payload)


def trace_session(phase: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: each call of the (sync or async) function is one execution of ``phase``."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*a: Any, **kw: Any) -> Any:
                async with trace_session_phase(phase):
                    return await fn(*a, **kw)

            return async_wrapper

        @functools.wraps(fn)
        def wrapper(*a: Any, **kw: Any) -> Any:
            with trace_session_phase(phase):
                return fn(*a, **kw)

        return wrapper

    return wrap


def trace_session_event(event: str, session_id: int | None = None, task_id: int | None = None,
                        **payload: Any) -> None:
    """A lifecycle event: ``mark_finalized`` (``status``, optional ``reason``), or
    ``mark_<phase>_start`` / ``mark_<phase>_end``. Targets ``session_id``, else every
    open session of ``task_id``, else the session (or task) of this context."""
    book = resolve_book()
    if book is None:
        return
    if session_id is not None:
        targets = [session_id]
    else:
        if task_id is None and _SESSION.get() is not None:
            targets = [_SESSION.get()]  # type: ignore[list-item]
        else:
            task = task_id if task_id is not None else _TASK.get()
            targets = list(book.tasks.get(task, ())) if task is not None else []
    if event == "mark_finalized":
        status = _text(payload.get("status", "accepted")) or "accepted"
        if status not in STATUSES:
            book.reporter.report("session:status", f"mark_finalized status {status!r} is not one of "
                                 f"{', '.join(STATUSES)}; stored as given")
        reason = _text(payload.get("reason"))
        for sid in targets:
            book.finalize(sid, status, reason)
        return
    match = _MARK.match(event) if isinstance(event, str) else None
    if match is None:
        book.reporter.report("session:event", f"unknown session event {event!r} (mark_finalized, "
                             "mark_<phase>_start or mark_<phase>_end); ignored")
        return
    phase = _text(match.group(1)) or ""
    data = payload or None
    for sid in targets:
        if match.group(2) == "start":
            book.phase_start(sid, phase, data)
        else:
            book.phase_end_by_name(sid, phase, data)
