"""The agent's process-wide lifecycle: init, the hot-path entry, shutdown, fork.

One Runtime per process, created by ``init()`` (explicitly or by the first
trace_step/log/span). It owns the recorder, the tracer, the sender thread and,
on the node's local rank 0, the in-process node relay. Everything here is
fail-open: failures are reported once on stderr and the training continues.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

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
        self.tracer: Any = None
        try:
            factory = (tracer_factory or _default_tracer_factory)()
            self.tracer = factory(
                self.recorder,
                deep_dive=config.deep_dive,
                deep_dive_every=config.deep_dive_every,
                # The tracer warns once per kind with an unprefixed message; one reporter
                # key per kind so every kind's first failure prints (with one prefix).
                warn=lambda kind, msg: self.reporter.report(f"tracer:{kind}", msg),
            )
        except Exception as exc:
            self.reporter.report("tracer", f"step capture unavailable ({exc!r}); sending resource samples only")
        # Only a tracer that says so (agent.tracer.Tracer) is trusted to hand out contexts that
        # never raise and never swallow; any other (a test double, a plug-in) gets Guarded.
        self._fail_open = getattr(self.tracer, "FAIL_OPEN_CONTEXTS", False) is True
        self._builder: Any = None
        self.sender = Sender(
            source=self._make_builder,
            hello=self._hello,
            host=config.relay_host,
            port=config.relay_port,
            token=config.token,
            flush_s=config.flush_s,
            buffer_bytes=config.buffer_bytes,
            reporter=self.reporter,
            prepare=self._start_relay if config.start_relay else None,
            on_reconnect=self._on_reconnect,
        )

    # --------------------------------------------------------------- lifecycle

    def start(self) -> None:
        if self.tracer is not None:
            try:
                self.tracer.install()
            except Exception as exc:
                self.reporter.report("tracer", f"step capture unavailable ({exc!r})")
                self.tracer = None
        self.sender.start()

    def stop(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        # The relay forwards our last batch upstream, so it needs a slice too.
        sender_share = timeout * (0.75 if self.relay is not None else 1.0)
        self.sender.stop(sender_share)
        if self.tracer is not None:
            try:
                self.tracer.uninstall()
            except Exception as exc:
                self.reporter.report("tracer", f"could not remove step hooks: {exc!r}")
        if self._builder is not None and self.sender.finished.is_set():
            self._builder.close()
        relay, self.relay = self.relay, None
        if relay is not None:
            try:
                relay.stop(max(0.2, deadline - time.monotonic()))
            except Exception as exc:
                self.reporter.report("relay", f"node relay did not stop cleanly: {exc!r}")

    # ----------------------------------------------------- sender-thread hooks

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
            )
        except Exception as exc:
            if _port_in_use(exc):
                # A standalone traceml-relay (or another rank) already serves
                # this node: just connect to it.
                self.reporter.count("relay-port-in-use")
            else:
                self.reporter.report("relay", f"could not start the node relay: {exc!r}")

    def _make_builder(self) -> Any:
        from agent.batch import BatchBuilder  # psutil import off the init() path

        self._builder = BatchBuilder(
            self.recorder,
            self.tracer,
            is_node_leader=lambda: self.identity.local_rank == 0,
            counters=self._counters,
            reporter=self.reporter,
        )
        return self._builder

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
        }

    def _hello(self, final: bool) -> HelloInfo | None:
        if not (self._settled or final or time.monotonic() - self._started_at > IDENTITY_GRACE_S):
            return None
        self._refresh_identity()
        ident = self.identity
        wire = ident.wire()
        if self.tracer is not None:
            try:
                wire["parallelism"] = str(self.tracer.parallelism())
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
        if not self._settled:
            self.settle()
        tracer = self.tracer
        if tracer is None:
            return NULL_CONTEXT
        if self._fail_open:
            # The tracer's per-model context is reused every step and already
            # catches its own errors: no wrapper to allocate on the hot path.
            return tracer.trace_step(model)
        return Guarded(tracer.trace_step(model), self.reporter, "step")

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
        disabled = False
        runtime = Runtime(config, env=env, tracer_factory=tracer_factory, relay_starter=relay_starter)
        runtime.start()
        current = runtime
        if not _atexit_registered:
            atexit.register(_at_exit)
            _atexit_registered = True
        return runtime


def implicit() -> Runtime | None:
    """The runtime for a call made before init(): init once, never after shutdown."""
    if disabled or _forked_child or _initialized:
        return current
    return init()


def shutdown(timeout: float | None = None) -> None:
    global current
    with _lock:
        runtime, current = current, None
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
    global _lock, current, _forked_child
    _lock = threading.Lock()
    current = None
    _forked_child = True
    reporter.after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
