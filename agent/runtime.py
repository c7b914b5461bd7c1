"""The agent's process-wide lifecycle: init, the hot-path entry, shutdown, fork.

One Runtime per process, created by ``init()`` (explicitly or by the first
trace_step/log/span). It owns the recorder, the tracer, the sender thread and,
on the node's local rank 0, the in-process node relay. Everything here is
fail-open: failures are reported once on stderr and the training continues.

``init()`` only reads the config and identity and starts the sender thread:
the tracer (``agent.tracer`` and the capture modules: milliseconds of imports)
is built and installed by that thread as its first job, once ``start()`` has
returned, so it is normally in place before the script's first DataLoader
fetch. It does so only when torch is already imported: importing torch from a
second thread while the script may be importing it is asking for an import
deadlock, and a script that has not imported torch has nothing to trace yet.
Otherwise, or when a training-thread call needs it sooner, the first
trace_step/log/span builds it (or waits for the build in progress).

The hot path, ``agent.trace_step(model)``, skips this module once the runtime
is settled: ``fast_models`` publishes the tracer's id(model) -> step context
map, and ``agent.trace_step`` looks the model up there itself (one dict
lookup and one weakref call per step, no call into the runtime).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import importlib.util
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from agent import sessions as _sessions
from agent import spans as _spans
from agent.config import Config, load_config
from agent.errors import ErrorReporter, reporter
from agent.identity import Identity, agent_sender_id, current_identity
from agent.recorder import Recorder
from agent.sender import HelloInfo, Sender

# Without a trace_step, a launcher that sets no rank variables may still be
# initializing torch.distributed; past this grace the hello goes out anyway.
IDENTITY_GRACE_S = 30.0

NULL_CONTEXT: contextlib.nullcontext[None] = contextlib.nullcontext()

TracerFactory = Callable[..., Any]
RelayStarter = Callable[..., Any]


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


def _default_tracer_factory() -> TracerFactory:
    from agent.tracer import Tracer  # lazy: the tracer imports torch

    return Tracer


def _default_relay_starter() -> RelayStarter:
    from relay.node import start_relay_thread  # lazy: only local rank 0 needs it

    return start_relay_thread


# The base install (a head node's) has no torch; ranks need the agent extra.
NO_TORCH_MESSAGE = (
    "torch is not installed, so the agent is off (every call is a no-op): "
    "pip install 'traceml-daemon[agent]' in the training environment"
)


def _torch_installed() -> bool:
    """torch can be imported here, found without importing it (init() must stay light)."""
    if sys.modules.get("torch") is not None:
        return True
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # a broken or blocked torch is as good as none
        return False


def _torch_imported() -> bool:
    """torch is in sys.modules and done initializing (not mid-import on another thread)."""
    torch = sys.modules.get("torch")
    spec = getattr(torch, "__spec__", None)
    return torch is not None and not getattr(spec, "_initializing", False)


def _port_in_use(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.EADDRINUSE:
            return True
        if "address already in use" in str(seen).lower():
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class Runtime:
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
        self._relay_starter = relay_starter or _default_relay_starter
        self.relay: Any = None
        self.recorder = Recorder(config.recorder_bytes)
        # Spans and rollout sessions queue on their own bounded buffers (a quarter and a half
        # of the recorder's budget), turned into rows on the sender thread.
        self.spans = _spans.SpanSink(config.recorder_bytes // 4, self.reporter)
        self.sessions = _sessions.SessionBook(config.recorder_bytes // 2, self.reporter)
        self.profiler = self._make_profiler() if config.profile_steps else None
        self._tracer_factory = tracer_factory or _default_tracer_factory
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

    def _device_sampling(self) -> dict[str, Any]:
        """The tracer's device_sampling keyword, only when the configuration asks for other than the default."""
        from agent.device_sampling import DeviceSamplingPolicy

        policy = DeviceSamplingPolicy(budget=self.config.device_budget, every=self.config.device_every or None)
        return {} if policy == DeviceSamplingPolicy() else {"device_sampling": policy}

    def _build_tracer(self) -> Any:
        with self._tracer_lock:
            if self._tracer_built or self._stopped:
                return self._tracer
            tracer: Any = None
            try:
                factory = self._tracer_factory()
                tracer = factory(
                    self.recorder,
                    deep_dive=self.config.deep_dive,
                    deep_dive_every=self.config.deep_dive_every,
                    # Only when on: a tracer factory of a test or plug-in need not know the keyword.
                    **({"fingerprint_every": self.config.fingerprint_every} if self.config.fingerprint_every else {}),
                    **self._device_sampling(),
                    # The tracer warns once per kind with an unprefixed message; one reporter
                    # key per kind so every kind's first failure prints (with one prefix).
                    # "notice:" kinds (ErrorGate.notice) are said once but are not failures.
                    warn=lambda kind, msg: (self.reporter.notice if kind.startswith("notice:") else
                                            self.reporter.report)(f"tracer:{kind}", msg),
                )
            except Exception as exc:
                self.reporter.report("tracer", f"step capture unavailable ({exc!r}); sending resource samples only")
            if tracer is not None:
                try:
                    tracer.install()
                except Exception as exc:
                    self.reporter.report("tracer", f"step capture unavailable ({exc!r})")
                    tracer = None
            # Only a tracer that says so (agent.tracer.Tracer) is trusted to hand out contexts that
            # never raise and never swallow; any other (a test double, a plug-in) gets Guarded.
            self._fail_open = getattr(tracer, "FAIL_OPEN_CONTEXTS", False) is True
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
            # Waiting for the node's other agents and the final flush share what is left
            # of the one shutdown budget (TRACEML_SHUTDOWN_S), never more.
            left = max(0.2, deadline - time.monotonic())
            try:
                relay.stop(left / 2, agent_grace=left / 2)
            except Exception as exc:
                self.reporter.report("relay", f"node relay did not stop cleanly: {exc!r}")

    # ----------------------------------------------------- sender-thread hooks

    def _prepare(self) -> None:
        """The sender thread's first job: the tracer, then (if configured) the node relay."""
        # Let start() (and init()) return first: building now would take the GIL from them.
        self._started.wait(1.0)
        if _torch_imported():
            self._build_tracer()
        if self.config.start_relay:
            self._start_relay()

    def _start_relay(self) -> None:
        """Local rank 0 hosts the node relay (runs on the sender thread)."""
        if self.identity.local_rank != 0:
            return
        ident = self.identity
        try:
            start = self._relay_starter()
            self.relay = start(
                port=self.config.relay_port,
                upstream=self.config.daemon,
                token=self.config.token,
                session=ident.session,
                node={"node_rank": ident.node_rank, "hostname": ident.hostname},
                spool_dir=None,
                tls_ca=self.config.tls_ca,
            )
        except Exception as exc:
            if _port_in_use(exc):
                # A standalone traceml-relay (or another rank) already serves
                # this node: just connect to it.
                self.reporter.count("relay-port-in-use")
            else:
                self.reporter.report("relay", f"could not start the node relay: {exc!r}")

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


# ------------------------------------------------------------------ singleton

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
        if tracer_factory is None and not _torch_installed():
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
