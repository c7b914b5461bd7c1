"""The daemon's asyncio shell: sockets in, the single writer out.

The listener (``net.listener``) hands every connection to ``net.handler``,
which runs its conversation under the connection limits (``net.limits``):
accepted batches go into one ``ByteQueue`` whose bound in bytes is the
backpressure; one ``StoreWriter`` task commits them and the ack goes back
only after COMMIT. Everything runs in one ``asyncio.TaskGroup`` so shutdown
is a single cancellation scope.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import ssl
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from traceml_daemon.analysis.policy import Policy
from traceml_daemon.ingest.counters import Counters
from traceml_daemon.ingest.live import Aggregates
from traceml_daemon.ingest.pipeline import StoreWriter, WorkItem
from traceml_daemon.net.control_requests import ControlRequests
from traceml_daemon.net.handler import READ_BUFFER, PeerHandler
from traceml_daemon.net.inbound import ByteBudget, ByteQueue
from traceml_daemon.net.limits import DAEMON_LIMITS
from traceml_daemon.net.listener import TLSListener, listen_tls, listening_port
from traceml_daemon.net.verdict_profiles import VerdictProfiler
from traceml_daemon.store.retention import RetentionPolicy
from traceml_wire.framing import DEFAULT_MAX_FRAME_BYTES
from traceml_wire.limits import ConnectionLimits

log = logging.getLogger("traceml_daemon.net.server")


@dataclass
class ServerConfig:
    db_path: str
    host: str = "127.0.0.1"
    port: int = 29765
    token: str | None = None
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    queue_bytes: int = 64 * 1024 * 1024
    # Connection caps, timeouts and the inbound byte budget (net/limits.py).
    limits: ConnectionLimits = DAEMON_LIMITS
    tls_cert: str | None = None
    tls_key: str | None = None
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # serve OpenMetrics on GET /metrics when set (0 = any free port)
    retention_days: float | None = None  # delete raw rows older than this (history stays)
    max_db_mb: float | None = None  # delete the oldest raw rows while the db uses more
    policy: Policy | None = None  # thresholds of the live diagnosis on /metrics (None: the defaults)
    profile_on_verdict: int | None = None  # K: profile the rank a straggler verdict names (net/verdict_profiles.py)


class DaemonServer:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.counters = Counters()
        self.aggregates = Aggregates()
        self.writer = StoreWriter(
            config.db_path,
            self.counters,
            self.aggregates,
            retention=RetentionPolicy.from_flags(config.retention_days, config.max_db_mb),
            # A full disk must not stop the daemon: what does not fit is acknowledged and counted.
            drop_when_full=True,
        )
        self.queue: ByteQueue[WorkItem] = ByteQueue(config.queue_bytes)
        self.peers = PeerHandler(
            token=config.token,
            max_frame_bytes=config.max_frame_bytes,
            limits=config.limits,
            counters=self.counters,
            queue=self.queue,
            # The writer makes its ingestor when it opens the database: looked up per hello.
            last_seq=lambda sender: self.writer.ingestor.last_seq(sender),
        )
        # `traceml-daemon profile --db` requests, beside the database (net/control_requests.py).
        self.controls = ControlRequests(config.db_path, self.peers.routes)
        self.verdict_profiles: VerdictProfiler | None = None
        if config.profile_on_verdict:
            # Its requests take the same route as the CLI's (ControlRoutes.send).
            self.verdict_profiles = VerdictProfiler(config.db_path, self.peers.routes, config.profile_on_verdict,
                                                    config.policy)
        self._tg: asyncio.TaskGroup | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self.bound: tuple[str, int] | None = None

    @property
    def inbound(self) -> ByteBudget:
        """Frames being read, every connection together."""
        return self.peers.inbound

    def _ssl_context(self) -> ssl.SSLContext | None:
        if not self.config.tls_cert:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.config.tls_cert, self.config.tls_key)
        return context

    async def serve(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set, then drain the queue, commit and return."""
        try:
            self.peers.ssl_context = self._ssl_context()
        except OSError as exc:  # ssl.SSLError is an OSError: a missing file or a key that does not match
            raise OSError(
                exc.errno,
                f"TLS --tls-cert {self.config.tls_cert} / --tls-key {self.config.tls_key}: {exc.strerror or exc}",
            ) from None
        await self.writer.open()
        try:
            # Bound before the TaskGroup so a busy port is a plain OSError, not an ExceptionGroup.
            server = await self._listen()
            metrics = await self._start_metrics(server)
            async with server, metrics or contextlib.nullcontext():
                await server.start_serving()
                # Before the TaskGroup, so a failed listen is a plain OSError too.
                port = listening_port(server)
                async with asyncio.TaskGroup() as tg:
                    self._tg = tg
                    self.bound = (self.config.host, port)
                    print(f"listening on {self.config.host}:{port}", flush=True)
                    log.info("listening on %s:%d (db %s)", self.config.host, port, self.config.db_path)
                    writer_task = tg.create_task(self.writer.run(self.queue))
                    controls = tg.create_task(self.controls.run())
                    watcher = tg.create_task(self.verdict_profiles.run()) if self.verdict_profiles else None
                    memdebug = self._start_memdebug(tg)
                    await stop.wait()
                    log.info("stopping: draining %d queued batches", len(self.queue))
                    server.close()
                    await self.queue.close()  # handlers blocked in put() give up; those batches were never acked
                    await writer_task
                    controls.cancel()
                    if watcher is not None:
                        watcher.cancel()
                    if memdebug is not None:
                        memdebug.cancel()
                    # Handlers are parked on reads; end them now that nothing more can be stored.
                    for task in list(self._conns):
                        task.cancel()
        finally:
            self._tg = None
            await self.writer.close()

    async def _listen(self) -> asyncio.Server | TLSListener:
        # Every relay reconnects at once after a daemon restart; the default backlog
        # (100) silently stalls the rest behind a full accept queue.
        limits = self.config.limits
        backlog = max(100, limits.max_connections + limits.max_unauthenticated)
        if self.peers.ssl_context is None:
            return await asyncio.start_server(
                self._on_connect,
                self.config.host,
                self.config.port,
                limit=READ_BUFFER,
                start_serving=False,
                backlog=backlog,
            )
        return await listen_tls(self.config.host, self.config.port, backlog, self._on_tls_accept)

    def _start_memdebug(self, tg: asyncio.TaskGroup) -> asyncio.Task[None] | None:
        """The memory report of ``memdebug`` when ``TRACEML_DEBUG_MEM`` asks for it."""
        from traceml_daemon.net import memdebug

        interval = memdebug.interval_from_env()
        if interval is None:
            return None

        def sizes() -> dict[str, int]:
            return {**self.writer.statistics(), "queue_bytes": self.queue.bytes_held,
                    "inbound_bytes": self.inbound.bytes_held, "conns": len(self.peers.gate)}

        return tg.create_task(memdebug.report_forever(interval, sizes))

    async def _start_metrics(self, server: asyncio.Server | TLSListener) -> asyncio.Server | None:
        """The optional /metrics endpoint, bound before the TaskGroup (a busy port stays a plain OSError)."""
        if self.config.metrics_port is None:
            return None
        from traceml_daemon.metrics.collect import MetricsCollector
        from traceml_daemon.metrics.exposition import start_metrics_server

        host = self.config.metrics_host
        collector = MetricsCollector(
            self.config.db_path, self.aggregates, self.counters, process_counters=self.writer.checkpointer.statistics,
            policy=self.config.policy,
        )
        metrics: asyncio.Server | None = None
        try:
            metrics = await start_metrics_server(host, self.config.metrics_port, collector.render)
            port = listening_port(metrics)
        except OSError as exc:
            if metrics is not None:
                metrics.close()
            server.close()
            raise OSError(exc.errno, f"metrics endpoint {host}:{self.config.metrics_port}: {exc.strerror}") from None
        print(f"metrics on http://{host}:{port}/metrics", flush=True)
        return metrics

    # ------------------------------------------------------------ connections

    def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._spawn(lambda: self.peers.plain(reader, writer), writer.close)

    def _on_tls_accept(self, conn: socket.socket, addr: Any) -> None:
        self._spawn(lambda: self.peers.tls(conn, addr), conn.close)

    def _spawn(self, conversation: Callable[[], Coroutine[Any, Any, None]], close: Callable[[], None]) -> None:
        """Run one peer's conversation in the server's task group (closed at once after shutdown)."""
        if self._tg is None:
            close()
            return
        task = self._tg.create_task(conversation())
        self._conns.add(task)
        task.add_done_callback(self._conns.discard)


async def run_server(config: ServerConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):  # Windows
            loop.add_signal_handler(sig, stop.set)
    server = DaemonServer(config)
    try:
        await server.serve(stop)
    except OSError as exc:
        print(f"traceml-daemon: cannot listen on {config.host}:{config.port}: {exc}", file=sys.stderr)
        return 1
    log.info("stopped; %s", server.counters.as_dict())
    return 0
