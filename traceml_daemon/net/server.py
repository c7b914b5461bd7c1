"""The daemon's asyncio shell: sockets in, the single writer out.

Each connection runs a ``ServerConnection`` (traceml_wire.conversation: the
whole protocol) over asyncio streams, fed frame by frame so that each frame's
bytes are reserved before its body is read; accepted batches, in the one shape
of ``net.peer.as_batch``, go into one ``ByteQueue`` whose bound in bytes is
the backpressure; one ``StoreWriter`` task commits them and the ack goes back
only after COMMIT. Everything runs in one ``asyncio.TaskGroup`` so shutdown
is a single cancellation scope.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import socket
import ssl
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from traceml_daemon.ingest.counters import Counters
from traceml_daemon.ingest.live import Aggregates
from traceml_daemon.ingest.pipeline import StoreWriter, WorkItem
from traceml_daemon.net.acks import AckWriter
from traceml_daemon.net.inbound import ByteBudget, ByteQueue, QueueClosed
from traceml_daemon.net.peer import Batch, as_batch, new_connection, tls_hint
from traceml_daemon.store.retention import RetentionPolicy
from traceml_wire import conversation as conv
from traceml_wire import messages
from traceml_wire.framing import DEFAULT_MAX_FRAME_BYTES, HEADER_BYTES

log = logging.getLogger("traceml_daemon.net.server")

# A connection's stream buffer: the transport stops reading the socket once it holds
# twice this. Kept small because there is one per connection (up to max_connections);
# what a connection has read beyond it is under ``ServerConfig.inbound_bytes``.
READ_BUFFER = 64 * 1024


@dataclass
class ServerConfig:
    db_path: str
    host: str = "127.0.0.1"
    port: int = 29765
    token: str | None = None
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    max_connections: int = 1024
    queue_bytes: int = 64 * 1024 * 1024
    # Frames read but not yet queued, all connections together (inbound.ByteBudget).
    inbound_bytes: int = 32 * 1024 * 1024
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


class _TLSListener:
    """The listening socket of a TLS daemon, with the ``asyncio.Server`` surface
    ``serve`` uses (``sockets``, ``start_serving``, ``close``, ``async with``).

    It accepts connections itself and hands each raw socket to ``on_accept``,
    which runs the handshake with ``loop.connect_accepted_socket``: a failed or
    stalled handshake then raises where the peer's address is known, so it can
    be logged with its reason. ``asyncio.start_server(ssl=...)`` drops those
    without a word, and upgrading each connection with ``start_tls`` loses the
    ClientHello on uvloop, which reads before the handler can pause the socket.
    """

    def __init__(self, sock: socket.socket, on_accept: Callable[[socket.socket, Any], None]) -> None:
        self.sockets = [sock]
        self._on_accept = on_accept
        self._task: asyncio.Task[None] | None = None

    async def start_serving(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._accept_forever())

    async def _accept_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, addr = await loop.sock_accept(self.sockets[0])
            except OSError as exc:
                # Out of file descriptors and the like: keep listening, without spinning.
                log.warning("accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            self._on_accept(conn, addr)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.sockets[0].close()

    async def __aenter__(self) -> _TLSListener:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


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
        self.inbound = ByteBudget(config.inbound_bytes)
        self._active = 0
        self._tg: asyncio.TaskGroup | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._tls: ssl.SSLContext | None = None
        self._handshaking = 0  # TLS handshakes in flight: they count against max_connections
        self.bound: tuple[str, int] | None = None

    def _ssl_context(self) -> ssl.SSLContext | None:
        if not self.config.tls_cert:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.config.tls_cert, self.config.tls_key)
        return context

    async def serve(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set, then drain the queue, commit and return."""
        try:
            self._tls = self._ssl_context()
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
                port = _listening_port(server)
                async with asyncio.TaskGroup() as tg:
                    self._tg = tg
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

    async def _listen(self) -> asyncio.Server | _TLSListener:
        # Every relay reconnects at once after a daemon restart; the default backlog
        # (100) silently stalls the rest behind a full accept queue.
        backlog = max(100, self.config.max_connections)
        if self._tls is None:
            return await asyncio.start_server(
                self._on_connect,
                self.config.host,
                self.config.port,
                limit=READ_BUFFER,
                start_serving=False,
                backlog=backlog,
            )
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(
            self.config.host, self.config.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        sock = socket.create_server((self.config.host, self.config.port), family=infos[0][0], backlog=backlog)
        sock.setblocking(False)
        return _TLSListener(sock, self._on_tls_accept)

    def _start_memdebug(self, tg: asyncio.TaskGroup) -> asyncio.Task[None] | None:
        """The memory report of ``memdebug`` when ``TRACEML_DEBUG_MEM`` asks for it."""
        from traceml_daemon.net import memdebug

        interval = memdebug.interval_from_env()
        if interval is None:
            return None

        def sizes() -> dict[str, int]:
            return {**self.writer.statistics(), "queue_bytes": self.queue.bytes_held,
                    "inbound_bytes": self.inbound.bytes_held, "conns": self._active}

        return tg.create_task(memdebug.report_forever(interval, sizes))

    async def _start_metrics(self, server: asyncio.Server) -> asyncio.Server | None:
        """The optional /metrics endpoint, bound before the TaskGroup (a busy port stays a plain OSError)."""
        if self.config.metrics_port is None:
            return None
        from traceml_daemon.metrics.collect import MetricsCollector
        from traceml_daemon.metrics.exposition import start_metrics_server

        host = self.config.metrics_host
        collector = MetricsCollector(
            self.config.db_path, self.aggregates, self.counters, process_counters=self.writer.checkpointer.statistics
        )
        metrics: asyncio.Server | None = None
        try:
            metrics = await start_metrics_server(host, self.config.metrics_port, collector.render)
            port = _listening_port(metrics)
        except OSError as exc:
            if metrics is not None:
                metrics.close()
            server.close()
            raise OSError(exc.errno, f"metrics endpoint {host}:{self.config.metrics_port}: {exc.strerror}") from None
        print(f"metrics on http://{host}:{port}/metrics", flush=True)
        return metrics

    # ------------------------------------------------------------ connections

    def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._spawn(lambda: self._handle(reader, writer), writer.close)

    def _on_tls_accept(self, conn: socket.socket, addr: Any) -> None:
        self._spawn(lambda: self._tls_handshake(conn, addr), conn.close)

    def _spawn(self, conversation: Callable[[], Coroutine[Any, Any, None]], close: Callable[[], None]) -> None:
        """Run one peer's conversation in the server's task group (closed at once after shutdown)."""
        if self._tg is None:
            close()
            return
        task = self._tg.create_task(conversation())
        self._conns.add(task)
        task.add_done_callback(self._conns.discard)

    async def _tls_handshake(self, conn: socket.socket, addr: Any) -> None:
        """Run the TLS handshake of an accepted socket, then the same conversation as a plaintext peer."""
        peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) and len(addr) >= 2 else str(addr)
        if self._at_capacity(peer, in_flight=self._handshaking):
            # Refused before the handshake: its CPU is the very cost a full daemon must not pay.
            conn.close()
            return
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=READ_BUFFER, loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        self._handshaking += 1
        try:
            # The handshake gets the hello timeout too: a silent peer must not hold a slot.
            transport, _ = await loop.connect_accepted_socket(
                lambda: protocol, conn, ssl=self._tls, ssl_handshake_timeout=self.config.hello_timeout
            )
        except OSError as exc:  # ssl.SSLError; ConnectionAbortedError when the timeout hits
            # The transport owns (and has closed) the socket by now: do not close it again.
            self.counters.refused_peers += 1
            log.warning("refused %s: TLS handshake failed: %s", peer, exc)
            return
        finally:
            self._handshaking -= 1
        await self._handle(reader, asyncio.StreamWriter(transport, protocol, reader, loop))

    def _at_capacity(self, peer: str, in_flight: int = 0) -> bool:
        """True (counted and logged as a refusal) when ``max_connections`` peers are
        connected, counting ``in_flight`` connections not yet conversing (TLS handshakes)."""
        if self._active + in_flight < self.config.max_connections:
            return False
        self.counters.refused_peers += 1
        log.warning("refused %s: too many connections (%d)", peer, self.config.max_connections)
        return True

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = _peer_name(writer)
        if self._at_capacity(peer):
            with contextlib.suppress(Exception):
                writer.write(conv.ServerConnection(None).send_refuse("too many connections"))
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
        conn = new_connection(self.config.token, self.config.max_frame_bytes)
        acks = AckWriter(writer, conn)
        writer.write(conn.send_challenge())
        try:
            # The hello must arrive in time: a silent or trickling peer (slowloris)
            # would otherwise hold a connection slot forever.
            async with asyncio.timeout(self.config.hello_timeout):
                hello = await self._await_hello(peer, conn, reader, writer)
        except TimeoutError:
            self.counters.refused_peers += 1
            log.warning("refused %s: no hello within %.0f s", peer, self.config.hello_timeout)
            with contextlib.suppress(Exception):
                writer.write(conn.send_refuse("no hello in time"))
            return
        if hello is None:
            return
        while await self._take_frame(peer, conn, hello, reader, acks):
            pass

    async def _take_frame(
        self, peer: str, conn: conv.ServerConnection, hello: conv.Hello, reader: asyncio.StreamReader, acks: AckWriter
    ) -> bool:
        """Read one frame, its body under the inbound budget, and act on it; False once
        the connection must close.

        Frame by frame, its bytes reserved before its body is read: a daemon whose
        writer is behind stops reading sockets with a bounded amount in hand, however
        many peers are sending. A method of its own so that nothing of the frame
        outlives it: as locals of the read loop, the last frame's bytes and decoded
        batch stayed alive while the handler waited for its next frame and for budget,
        about a frame per connection."""
        events = await self._read_header(peer, hello, conn, reader)
        if events is None:
            return False
        if events:  # refused from the header alone, before a byte of the body is read
            return await self._on_event(peer, hello, events[0], acks)
        declared = conn.next_frame_length
        assert declared is not None
        async with self.inbound.hold(HEADER_BYTES + declared):
            events = await self._read_body(peer, hello, conn, reader)
            for event in events or ():
                if not await self._on_event(peer, hello, event, acks):
                    return False
            return events is not None

    async def _read_header(
        self, peer: str, hello: conv.Hello | None, conn: conv.ServerConnection, reader: asyncio.StreamReader
    ) -> list[conv.Event] | None:
        """The next frame's header into the conversation; None at EOF. Exactly one frame
        is read per step, never a byte beyond it, so the frame after an accepted hello
        meets the full cap, not the pre-hello one."""
        try:
            header = await reader.readexactly(HEADER_BYTES)
        except asyncio.IncompleteReadError:
            log.info("disconnect %s (%s)", peer, hello.sender if hello else "before hello")
            return None
        return conn.receive_data(header)

    async def _read_body(
        self, peer: str, hello: conv.Hello | None, conn: conv.ServerConnection, reader: asyncio.StreamReader
    ) -> list[conv.Event] | None:
        """The body of the frame whose header is in, through the conversation; None at EOF.
        The events hold what they need (a batch's bodies), the frame's bytes go here."""
        declared = conn.next_frame_length
        assert declared is not None
        try:
            body = await reader.readexactly(declared)
        except asyncio.IncompleteReadError:
            log.info("disconnect %s (%s) inside a frame", peer, hello.sender if hello else "before hello")
            return None
        before = conn.frames_received
        events = conn.receive_data(body)
        self.counters.frames_received += conn.frames_received - before
        return events

    async def _await_hello(
        self, peer: str, conn: conv.ServerConnection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> conv.Hello | None:
        """Read the first frame under the pre-hello cap; accept it if it is a good hello.
        None once the peer is refused or gone."""
        events = await self._read_header(peer, None, conn, reader)
        if events == []:
            events = await self._read_body(peer, None, conn, reader)
        if not events:
            return None
        (event,) = events  # the conversation reads nothing past a hello, good or bad
        if isinstance(event, conv.BadHello):
            if event.oversize:
                self.counters.oversize_frames += 1
            else:
                self.counters.refused_peers += 1
            log.warning("refused %s: %s%s", peer, event.reason, tls_hint(event.declared))
            with contextlib.suppress(Exception):
                writer.write(conn.send_refuse(event.reason))
                await writer.drain()
            return None
        assert isinstance(event, conv.Hello)
        # An agent talking directly resumes after what is stored; relays keep
        # their own resend buffer and learn what is safe from acks.
        last_seq = self.writer.ingestor.last_seq(event.sender) if event.role == messages.ROLE_AGENT else 0
        self.counters.connections += 1
        log.info("connect %s role=%s sender=%s session=%s", peer, event.role, event.sender, event.session)
        writer.write(conn.send_accept(last_seq))
        await writer.drain()
        return event

    async def _on_event(self, peer: str, hello: conv.Hello, event: conv.Event, acks: AckWriter) -> bool:
        """Act on one event of an accepted peer; False once the connection must close."""
        if isinstance(event, (conv.Batch, conv.RelayBatch)):
            return await self._enqueue(hello, as_batch(hello, event), acks)
        if isinstance(event, conv.ProtocolFailure):
            if event.oversize:
                self.counters.oversize_frames += 1
            else:
                self.counters.protocol_errors += 1
            log.warning("closing %s: %s", peer, event.reason)
        elif isinstance(event, conv.Bye):
            log.info("bye %s (%s)", peer, hello.sender)
        return False

    async def _enqueue(self, hello: conv.Hello, batch: Batch, acks: AckWriter) -> bool:
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
            # Once one of this connection's batches failed, the relay resends everything
            # after it on a new connection: what this one still has queued must not be
            # stored first (a later seq committed makes the resent earlier one a duplicate).
            live=lambda: not acks.failed,
        )
        try:
            await self.queue.put(item, batch.nbytes)
        except QueueClosed:
            return False
        return True


def _listening_port(server: asyncio.Server | _TLSListener) -> int:
    """The port ``server`` listens on. uvloop binds in create_server but listens in
    start_serving, and a listen that fails there (another process began listening on
    the port in between) only closes the socket, leaving None in ``sockets``."""
    sockets = server.sockets
    if not sockets or sockets[0] is None:
        raise OSError(errno.EADDRINUSE, "the port was bound but could not be listened on; is another process "
                      "listening on it? Choose another --port")
    return int(sockets[0].getsockname()[1])


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
