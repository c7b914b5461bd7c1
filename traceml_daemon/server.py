"""The daemon's asyncio shell: sockets in, the single writer out.

Each connection runs a ``PeerSession`` (the protocol logic) over asyncio
streams; accepted batches go into one ``ByteQueue`` whose bound in bytes is
the backpressure; one ``StoreWriter`` task commits them and the ack goes back
only after COMMIT. Everything runs in one ``asyncio.TaskGroup`` so shutdown
is a single cancellation scope.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import ssl
import sys
from dataclasses import dataclass

from traceml_daemon.acks import AckWriter
from traceml_daemon.aggregates import Aggregates
from traceml_daemon.counters import Counters
from traceml_daemon.inbound import ByteQueue, QueueClosed
from traceml_daemon.session import Batch, Closed, Event, Failed, Hello, PeerSession, Refused
from traceml_daemon.store.retention import RetentionPolicy
from traceml_daemon.store.writer import StoreWriter, WorkItem
from traceml_wire import messages
from traceml_wire.framing import DEFAULT_MAX_FRAME_BYTES

log = logging.getLogger("traceml_daemon.server")

READ_CHUNK = 256 * 1024


@dataclass
class ServerConfig:
    db_path: str
    host: str = "127.0.0.1"
    port: int = 29765
    token: str | None = None
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    max_connections: int = 1024
    queue_bytes: int = 64 * 1024 * 1024
    hello_timeout: float = 10.0
    tls_cert: str | None = None
    tls_key: str | None = None
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # serve OpenMetrics on GET /metrics when set (0 = any free port)
    retention_days: float | None = None  # delete raw rows older than this (history stays)
    max_db_mb: float | None = None  # delete the oldest raw rows while the db uses more



def _peer_name(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer)


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
        )
        self.queue: ByteQueue[WorkItem] = ByteQueue(config.queue_bytes)
        self._active = 0
        self._tg: asyncio.TaskGroup | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self.bound: tuple[str, int] | None = None

    def _ssl_context(self) -> ssl.SSLContext | None:
        if not self.config.tls_cert:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.config.tls_cert, self.config.tls_key)
        return context

    async def serve(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set, then drain the queue, commit and return."""
        await self.writer.open()
        try:
            # Bound before the TaskGroup so a busy port is a plain OSError, not an ExceptionGroup.
            server = await asyncio.start_server(
                self._on_connect,
                self.config.host,
                self.config.port,
                ssl=self._ssl_context(),
                limit=READ_CHUNK,
                start_serving=False,
                # Every relay reconnects at once after a daemon restart; the default backlog
                # (100) silently stalls the rest behind a full accept queue.
                backlog=max(100, self.config.max_connections),
            )
            metrics = await self._start_metrics(server)
            async with server, metrics or contextlib.nullcontext(), asyncio.TaskGroup() as tg:
                self._tg = tg
                await server.start_serving()
                port = server.sockets[0].getsockname()[1]
                self.bound = (self.config.host, port)
                print(f"listening on {self.config.host}:{port}", flush=True)
                log.info("listening on %s:%d (db %s)", self.config.host, port, self.config.db_path)
                writer_task = tg.create_task(self.writer.run(self.queue))
                memdebug = self._start_memdebug(tg)
                await stop.wait()
                log.info("stopping: draining %d queued batches", len(self.queue))
                server.close()
                await self.queue.close()  # handlers blocked in put() give up; those batches were never acked
                await writer_task
                if memdebug is not None:
                    memdebug.cancel()
                # Handlers are parked on reads; end them now that nothing more can be stored.
                for task in list(self._conns):
                    task.cancel()
        finally:
            self._tg = None
            await self.writer.close()

    def _start_memdebug(self, tg: asyncio.TaskGroup) -> asyncio.Task[None] | None:
        """The memory report of ``memdebug`` when ``TRACEML_DEBUG_MEM`` asks for it."""
        from traceml_daemon import memdebug

        interval = memdebug.interval_from_env()
        if interval is None:
            return None

        def sizes() -> dict[str, int]:
            return {**self.writer.statistics(), "queue_bytes": self.queue.bytes_held, "conns": self._active}

        return tg.create_task(memdebug.report_forever(interval, sizes))

    async def _start_metrics(self, server: asyncio.Server) -> asyncio.Server | None:
        """The optional /metrics endpoint, bound before the TaskGroup (a busy port stays a plain OSError)."""
        if self.config.metrics_port is None:
            return None
        from traceml_daemon.metrics import start_metrics_server
        from traceml_daemon.metrics_collect import MetricsCollector

        host = self.config.metrics_host
        collector = MetricsCollector(self.config.db_path, self.aggregates, self.counters)
        try:
            metrics = await start_metrics_server(host, self.config.metrics_port, collector.render)
        except OSError as exc:
            server.close()
            raise OSError(exc.errno, f"metrics endpoint {host}:{self.config.metrics_port}: {exc.strerror}") from None
        port = metrics.sockets[0].getsockname()[1]
        print(f"metrics on http://{host}:{port}/metrics", flush=True)
        return metrics

    # ------------------------------------------------------------ connections

    def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._tg is None:
            writer.close()
            return
        task = self._tg.create_task(self._handle(reader, writer))
        self._conns.add(task)
        task.add_done_callback(self._conns.discard)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = _peer_name(writer)
        if self._active >= self.config.max_connections:
            self.counters.refused_peers += 1
            log.warning("refused %s: too many connections (%d)", peer, self.config.max_connections)
            with contextlib.suppress(Exception):
                writer.write(PeerSession(None).refuse("too many connections"))
                await writer.drain()
            writer.close()
            return
        self._active += 1
        try:
            await self._converse(peer, reader, writer)
        except asyncio.CancelledError:
            raise
        except (ConnectionError, ssl.SSLError) as exc:
            log.info("disconnect %s: %s", peer, exc.__class__.__name__)
        except Exception:
            # One peer's failure must never take the daemon (the TaskGroup) down.
            log.exception("connection %s failed", peer)
        finally:
            self._active -= 1
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _converse(self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session = PeerSession(self.config.token, self.config.max_frame_bytes)
        acks = AckWriter(writer)
        writer.write(session.challenge())
        hello: Hello | None = None
        try:
            # The hello must arrive in time: a silent or trickling peer (slowloris)
            # would otherwise hold a connection slot forever. Lifted once accepted.
            async with asyncio.timeout(self.config.hello_timeout) as deadline:
                while True:
                    data = await reader.read(READ_CHUNK)
                    if not data:
                        log.info("disconnect %s (%s)", peer, hello.sender if hello else "before hello")
                        return
                    for event in self._receive(session, data):
                        if isinstance(event, Hello):
                            hello = event
                            deadline.reschedule(None)
                            await self._on_hello(peer, session, hello, writer)
                        elif not await self._on_event(peer, session, hello, event, writer, acks):
                            return
        except TimeoutError:
            if hello is not None:
                raise
            self.counters.refused_peers += 1
            log.warning("refused %s: no hello within %.0f s", peer, self.config.hello_timeout)
            with contextlib.suppress(Exception):
                writer.write(session.refuse("no hello in time"))

    def _receive(self, session: PeerSession, data: bytes) -> list[Event]:
        before = session.frames_received
        events = session.receive(data)
        self.counters.frames_received += session.frames_received - before
        return events

    async def _on_hello(self, peer: str, session: PeerSession, hello: Hello, writer: asyncio.StreamWriter) -> None:
        # An agent talking directly resumes after what is stored; relays keep
        # their own resend buffer and learn what is safe from acks.
        last_seq = self.writer.ingestor.last_seq(hello.sender) if hello.role == messages.ROLE_AGENT else 0
        self.counters.connections += 1
        log.info("connect %s role=%s sender=%s session=%s", peer, hello.role, hello.sender, hello.session)
        writer.write(session.accept(last_seq))
        await writer.drain()

    async def _on_event(
        self,
        peer: str,
        session: PeerSession,
        hello: Hello | None,
        event: Event,
        writer: asyncio.StreamWriter,
        acks: AckWriter,
    ) -> bool:
        """Act on one event; False once the connection must close."""
        if isinstance(event, Batch):
            assert hello is not None  # the session only yields batches after a hello
            return await self._enqueue(hello, event, acks)
        if isinstance(event, Refused):
            self.counters.refused_peers += 1
            log.warning("refused %s: %s", peer, event.reason)
            writer.write(session.refuse(event.reason))
            with contextlib.suppress(Exception):
                await writer.drain()
            return False
        if isinstance(event, Failed):
            if event.oversize:
                self.counters.oversize_frames += 1
            else:
                self.counters.protocol_errors += 1
            log.warning("closing %s: %s", peer, event.reason)
            return False
        if isinstance(event, Closed):
            log.info("bye %s (%s)", peer, hello.sender if hello else "?")
        return False

    async def _enqueue(self, hello: Hello, batch: Batch, acks: AckWriter) -> bool:
        def done(ok: bool, seq: int = batch.seq) -> None:
            if ok:
                acks.ack(seq)
            else:
                acks.fail()

        item = WorkItem(
            relay_sender=hello.sender,
            session=hello.session,
            seq=batch.seq,
            items=batch.items,
            peers=batch.peers,
            node=batch.node,
            stats=batch.stats,
            done=done,
        )
        try:
            await self.queue.put(item, batch.nbytes)
        except QueueClosed:
            return False
        return True


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
