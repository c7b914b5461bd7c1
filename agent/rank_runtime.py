"""One process's agent runtime: what ``init()`` starts and ``shutdown()`` stops.

A Runtime owns the recorder, the tracer, the sender thread and, on the node's
local rank 0, the in-process node relay (agent.node_relay); with them the
rank's output capture, the step profiler and the answers to the daemon's
control requests. Everything here is fail-open: failures are reported once on
stderr and the training continues. agent.runtime holds the process's one
Runtime and routes the public calls to it.

``init()`` only reads the config and identity and starts the sender thread:
the tracer (``agent.tracer`` and the capture modules: milliseconds of imports)
is built and installed by that thread as its first job, once ``start()`` has
returned, so it is normally in place before the script's first DataLoader
fetch. It does so only when torch is already imported: importing torch from a
second thread while the script may be importing it is asking for an import
deadlock, and a script that has not imported torch has nothing to trace yet.
Otherwise, or when a training-thread call needs it sooner, the first
trace_step/log/span builds it (or waits for the build in progress).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from agent import sessions as _sessions
from agent import spans as _spans
from agent.config import Config
from agent.errors import ErrorReporter, reporter
from agent.identity import Identity, agent_sender_id, current_identity
from agent.node_relay import RelayStarter, default_relay_starter, start_node_relay, stop_node_relay
from agent.recorder import Recorder
from agent.sender import HelloInfo, Sender
from agent.tracer_build import TracerFactory, build_tracer, contexts_fail_open, default_tracer_factory, torch_imported

# Without a trace_step, a launcher that sets no rank variables may still be
# initializing torch.distributed; past this grace the hello goes out anyway.
IDENTITY_GRACE_S = 30.0

NULL_CONTEXT: contextlib.nullcontext[None] = contextlib.nullcontext()


class Guarded:
    """Wraps the tracer's context manager so its own errors never reach the user.

    The user's exception (if any) always propagates unchanged: ``__exit__``
    returns False unless the tracer deliberately returned True.
    """

    __slots__ = ("_inner", "_reporter", "_kind")

    def __init__(self, inner: Any, reporter_: ErrorReporter, kind: str) -> None:
        self._inner = inner
        self._reporter = reporter_
        self._kind = kind

    def __enter__(self) -> None:
        try:
            self._inner.__enter__()
        except Exception as exc:
            self._reporter.report(self._kind, f"{self._kind} capture failed: {exc!r}")
            self._inner = NULL_CONTEXT

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        try:
            return bool(self._inner.__exit__(exc_type, exc, tb)) and exc_type is None
        except Exception as err:
            if err is not exc:
                self._reporter.report(self._kind, f"{self._kind} capture failed: {err!r}")
            return False


class Runtime:
    """This process's agent: its parts, started by ``start()`` and stopped by ``stop()``."""

    def __init__(
        self,
        config: Config,
        *,
        env: Mapping[str, str] | None = None,
        tracer_factory: Callable[[], TracerFactory] | None = None,
        relay_starter: Callable[[], RelayStarter] | None = None,
        reporter_: ErrorReporter | None = None,
    ) -> None:
        self.config = config
        self._env = os.environ if env is None else env
        self.reporter = reporter_ or reporter
        self.identity: Identity = current_identity(self._env)
        # Env-given ranks (torchrun, Slurm) are final; otherwise wait for the
        # first trace_step, when torch.distributed is normally up.
        self._settled = self.identity.source != "single"
        self._started_at = time.monotonic()
        self._rand = secrets.token_hex(3)
        self._relay_starter = relay_starter or default_relay_starter
        self.relay: Any = None
        self.recorder = Recorder(config.recorder_bytes)
        # Spans and rollout sessions queue on their own bounded buffers (a quarter and a half
        # of the recorder's budget), turned into rows on the sender thread.
        self.spans = _spans.SpanSink(config.recorder_bytes // 4, self.reporter)
        self.sessions = _sessions.SessionBook(config.recorder_bytes // 2, self.reporter)
        self.profiler = self._make_profiler() if config.profile_steps else None
        self._tracer_factory = tracer_factory or default_tracer_factory
        self._tracer: Any = None
        self._tracer_built = False  # built (or failed to build): read without the lock
        self._tracer_lock = threading.Lock()
        self._stopped = False
        self._started = threading.Event()  # start() returned: the sender thread may build
        self._fail_open = False
        self._builder: Any = None
        self.output: Any = None  # agent.output_capture.OutputCapture while the rank's output is captured
        self._control: Any = None  # agent.control.ControlHandler, made at the first request
        self.sender = Sender(
            source=self._make_builder,
            hello=self._hello,
            host=config.relay_host,
            port=config.relay_port,
            token=config.token,
            flush_s=config.flush_s,
            buffer_bytes=config.buffer_bytes,
            reporter=self.reporter,
            prepare=self._prepare,
            on_reconnect=self._on_reconnect,
            on_control=self._on_control,
        )

    # --------------------------------------------------------------- lifecycle

    @property
    def tracer(self) -> Any:
        """The step tracer, built on first use (normally by the sender thread); None if unavailable."""
        if self._tracer_built:
            return self._tracer
        return self._build_tracer()

    def _build_tracer(self) -> Any:
        with self._tracer_lock:
            if self._tracer_built or self._stopped:
                return self._tracer
            tracer = build_tracer(self._tracer_factory, self.recorder, self.config, self.reporter)
            self._fail_open = contexts_fail_open(tracer)  # else trace_step and span wrap in Guarded
            self._tracer = tracer
            self.spans.tracer = tracer  # spans carry the step in progress
            if self.profiler is not None and tracer is not None:
                tracer._rare = True  # the out-of-line step branch calls the profiler while armed
            self._tracer_built = True
        builder = self._builder
        if builder is not None and tracer is not None:
            builder.set_tracer(tracer)  # built after the sender's BatchBuilder: hand it over
        return tracer

    def start(self) -> None:
        # The tracer is built on the sender thread (its first job, _prepare): init() returns
        # without importing the capture machinery.
        if self.config.capture_output:
            self._start_output()
        self.sender.start()
        self._started.set()

    def stop(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        # First the console gets its descriptors back and the pipes are read out (a traceback
        # printed at exit), so the final flush below carries the last lines.
        self._stop_output(min(0.5, timeout / 4))
        if self.profiler is not None:
            self.profiler.close()  # a profile still open (the last step listed): written before the last flush
        # The relay forwards our last batch upstream, so it needs a slice too.
        sender_share = timeout * (0.75 if self.relay is not None else 1.0)
        self.sender.stop(sender_share)
        with self._tracer_lock:  # waits out a build in progress; none starts after this
            self._stopped = True
            tracer = self._tracer
        if tracer is not None:
            try:
                tracer.uninstall()
            except Exception as exc:
                self.reporter.report("tracer", f"could not remove step hooks: {exc!r}")
        if self._builder is not None and self.sender.finished.is_set():
            self._builder.close()
        relay, self.relay = self.relay, None
        if relay is not None:
            stop_node_relay(relay, max(0.2, deadline - time.monotonic()), self.reporter)

    # ----------------------------------------------------- sender-thread hooks

    def _prepare(self) -> None:
        """The sender thread's first job: the tracer, then (if configured) the node relay."""
        # Let start() (and init()) return first: building now would take the GIL from them.
        self._started.wait(1.0)
        if torch_imported():
            self._build_tracer()
        if self.config.start_relay:
            self.relay = start_node_relay(self.config, self.identity, self._relay_starter, self.reporter)

    def _start_output(self) -> None:
        from agent.output_capture import OutputCapture

        capture = OutputCapture(
            lines_per_s=self.config.output_lines_per_s,
            warn=lambda msg: self.reporter.report("output-capture", msg),
        )
        try:
            capture.start()
        except OSError as exc:
            self.reporter.report("output-capture", f"rank output not captured: {exc!r}")
            return
        self.output = capture

    def _stop_output(self, timeout: float) -> None:
        capture = self.output
        if capture is None:
            return
        try:
            capture.stop(timeout)
        except Exception as exc:
            self.reporter.report("output-capture", f"could not restore stdout/stderr: {exc!r}")

    def _drain_output(self) -> dict[str, list[Any]] | None:
        capture = self.output
        return None if capture is None else capture.drain()

    def _make_builder(self) -> Any:
        from agent.batch import BatchBuilder  # psutil import off the init() path

        builder = BatchBuilder(
            self.recorder,
            self._tracer,
            is_node_leader=lambda: self.identity.local_rank == 0,
            counters=self._counters,
            reporter=self.reporter,
            output=self._drain_output,
            extra=self._extra_tables,
        )
        self._builder = builder
        # A tracer the training thread built meanwhile (its build hands it to _builder too).
        if self._tracer is not None:
            builder.set_tracer(self._tracer)
        return builder

    def _make_profiler(self) -> Any:
        from agent.profiler import StepProfiler

        return StepProfiler(
            self.config.profile_steps, self.config.profile_dir, label=self.identity.session,
            rank=lambda: self.identity.global_rank, on_written=lambda row: self.recorder.add("profiles", row),
            reporter=self.reporter,
        )

    def _on_control(self, control: Any) -> None:
        """A request the daemon sent down (sender thread): see agent.control."""
        if self._control is None:
            from agent.control import ControlHandler

            self._control = ControlHandler(self)
        self._control(control)

    def _extra_tables(self) -> dict[str, dict[str, list[Any]]]:
        if self._control is not None:
            self._control.keep_armed()  # a profile request still waiting for its step
        tables = self.sessions.take()
        spans = self.spans.take()
        if spans is not None:
            tables["spans"] = spans
        return tables

    def _on_reconnect(self) -> None:
        if self._builder is not None:
            self._builder.resend_models()

    def _counters(self) -> dict[str, int]:
        buf = self.sender.buffer
        return {
            "recorder_rows": self.recorder.rows_dropped,
            "sender_batches": buf.dropped_batches,
            "sender_bytes": buf.dropped_bytes,
            "agent_errors": self.reporter.total(),
            **(self.output.counters() if self.output is not None else {}),
            "spans_dropped": self.spans.dropped,
            **self.sessions.counters(),
        }

    def _hello(self, final: bool) -> HelloInfo | None:
        if not (self._settled or final or time.monotonic() - self._started_at > IDENTITY_GRACE_S):
            return None
        self._refresh_identity()
        ident = self.identity
        wire = ident.wire()
        tracer = self._tracer  # not built yet: this thread does not build it for the hello
        if tracer is not None:
            try:
                wire["parallelism"] = str(tracer.parallelism())
            except Exception:
                self.reporter.count("tracer-parallelism")
        return HelloInfo(sender=agent_sender_id(ident, self._rand), session=ident.session, identity=wire)

    def _refresh_identity(self) -> None:
        try:
            self.identity = current_identity(self._env)
        except Exception as exc:
            self.reporter.report("identity", f"could not resolve rank identity: {exc!r}")

    # ------------------------------------------------------------ user calls

    def settle(self) -> None:
        """First trace_step: torch.distributed is up now; let the hello go."""
        self._settled = True
        self._refresh_identity()
        self.sender.poke()

    def trace_step(self, model: Any) -> Any:
        tracer = self.tracer
        if tracer is None:
            ctx: Any = NULL_CONTEXT
        elif self._fail_open:
            # The tracer's per-model context is reused every step and already
            # catches its own errors: no wrapper to allocate on the hot path.
            ctx = tracer.trace_step(model)
        else:
            ctx = Guarded(tracer.trace_step(model), self.reporter, "step")
        if not self._settled:
            # After the model is registered, so the hello this lets out knows its parallelism.
            self.settle()
        return ctx

    def span(self, name: str, args: dict[str, Any]) -> Any:
        tracer = self.tracer
        if tracer is None:
            return NULL_CONTEXT
        if self._fail_open:
            return tracer.span(name, **args)
        return Guarded(tracer.span(name, **args), self.reporter, "span")
