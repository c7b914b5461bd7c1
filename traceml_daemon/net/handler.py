"""One peer of the daemon, from its accept to its close.

A connection first takes a slot of the ``ConnectionGate`` (unauthenticated
peers have caps of their own, so sockets without a hello never keep a relay
with the token out), then runs a ``ServerConnection`` (traceml_wire.
conversation: the whole protocol) over asyncio streams, read by a
``ServerReader``: the hello within the hello timeout, then frame by frame,
each frame's bytes reserved from the shared ``ByteBudget`` before its body is
read, within the idle and read timeouts. Accepted batches, in the one shape of
``net.peer.as_batch``, go into the writer's ``ByteQueue``; the ack goes back
after COMMIT (``net.acks``).

Every string a peer sent (sender, session, role, a reason built from its
message) goes through ``printable`` before it reaches the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Callable
from typing import Any

from traceml_daemon.ingest.counters import Counters
from traceml_daemon.ingest.pipeline import WorkItem
from traceml_daemon.net.acks import AckWriter
from traceml_daemon.net.inbound import ByteQueue, QueueClosed
from traceml_daemon.net.listener import address_of
from traceml_daemon.net.peer import Batch, as_batch, new_connection, tls_hint
from traceml_daemon.net.routes import ControlRoutes, RoutedConnection, RouteError
from traceml_wire import connection_events as conv
from traceml_wire import messages
from traceml_wire.aio import ByteBudget, IdleTimeout, ReadTimeout, ServerReader
from traceml_wire.limits import ConnectionGate, ConnectionLimits, set_keepalive
from traceml_wire.printable import printable
from traceml_wire.ratelimit import LineLimiter
from traceml_wire.server_connection import ServerConnection

log = logging.getLogger("traceml_daemon.net.server")

# A connection's stream buffer: the transport stops reading the socket once it holds
# twice this. Kept small because there is one per connection; what a connection has
# read beyond it is under the limits' inbound byte budget.
READ_BUFFER = 64 * 1024

class Slot:
    """One connection's place in the gate, and how to close it should a newer peer
    take the place: its transport's abort, or during a TLS handshake its task's
    cancel. Dropped at the end, so no finished task stays reachable from here."""

    __slots__ = ("peer", "evicted", "_close")

    def __init__(self, peer: str, close: Callable[[], object]) -> None:
        self.peer = peer
        self.evicted = False
        self._close: Callable[[], object] | None = close

    def closes_with(self, close: Callable[[], object]) -> None:
        self._close = close

    def evict(self) -> None:
        close, self._close = self._close, None
        self.evicted = True
        if close is not None:
            close()

    def done(self) -> None:
        self._close = None


class PeerHandler:
    """The conversations of every peer of one daemon: ``plain`` and ``tls`` each run
    one connection to its end, in a task of its own."""

    def __init__(
        self,
        *,
        token: str | None,
        max_frame_bytes: int,
        limits: ConnectionLimits,
        counters: Counters,
        queue: ByteQueue[WorkItem],
        last_seq: Callable[[str], int],
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._token = token
        self._max_frame_bytes = max_frame_bytes
        self.limits = limits
        self.counters = counters
        self.queue = queue
        self._last_seq = last_seq
        self.ssl_context = ssl_context
        self.gate: ConnectionGate[Slot] = ConnectionGate(limits)
        self.inbound = ByteBudget(limits.inbound_bytes)
        # Evictions come as fast as someone opens sockets: their lines are held to a rate.
        self._lines = LineLimiter()
        # Which connection carries which agent, for control requests (net/routes.py).
        self.routes = ControlRoutes()

    # ------------------------------------------------------------ admission

    def _admit(self, slot: Slot, host: str) -> str | None:
        """Take a slot for a new connection; None when it may converse, else why not.
        Unauthenticated peers that lose their slot to it are closed here."""
        admission = self.gate.admit(slot, host)
        for victim in admission.evict:
            self.counters.refused_peers += 1
            line = self._lines.line("evicted", f"refused {victim.peer}: no hello yet and its slot went to a newer peer")
            if line is not None:
                log.warning("%s", line)
            victim.evict()
        if not admission.admitted:
            self.counters.refused_peers += 1
            log.warning("refused %s: %s", slot.peer, admission.reason)
            return admission.reason
        return None

    def _release(self, slot: Slot) -> None:
        self.gate.release(slot)
        slot.done()

    # ------------------------------------------------------------ connections

    async def plain(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A plaintext connection, from its accept to its close."""
        host, peer = address_of(writer.get_extra_info("peername"))
        set_keepalive(writer.get_extra_info("socket"), self.limits.keepalive)
        # Evicted by aborting its transport: its reads end as at any EOF, no cancellation.
        slot = Slot(peer, writer.transport.abort)
        reason = self._admit(slot, host)
        if reason is not None:
            with contextlib.suppress(Exception):
                writer.write(ServerConnection(None).send_refuse(reason))
                await writer.drain()
            writer.close()
            return
        await self._run(slot, reader, writer)

    async def tls(self, conn: socket.socket, addr: Any) -> None:
        """A TLS connection: the handshake (its slot is an unauthenticated one, taken
        before it: its CPU is the very cost a full daemon must not pay), then the same
        conversation as a plaintext peer."""
        host, peer = address_of(addr)
        current = asyncio.current_task()
        assert current is not None
        slot = Slot(peer, current.cancel)  # no transport yet to abort
        del current
        if self._admit(slot, host) is not None:
            conn.close()
            return
        set_keepalive(conn, self.limits.keepalive)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=READ_BUFFER, loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        try:
            # The handshake gets the hello timeout too: a silent peer must not hold a slot.
            transport, _ = await loop.connect_accepted_socket(
                lambda: protocol, conn, ssl=self.ssl_context, ssl_handshake_timeout=self.limits.hello_timeout
            )
        except OSError as exc:  # ssl.SSLError; ConnectionAbortedError when the timeout hits
            # The transport owns (and has closed) the socket by now: do not close it again.
            self._release(slot)
            self.counters.refused_peers += 1
            log.warning("refused %s: TLS handshake failed: %s", peer, exc)
            return
        except BaseException:
            self._release(slot)
            raise
        slot.closes_with(transport.abort)
        await self._run(slot, reader, asyncio.StreamWriter(transport, protocol, reader, loop))

    async def _run(self, slot: Slot, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = slot.peer
        try:
            await self._converse(slot, reader, writer)
        except asyncio.CancelledError:
            raise
        except (ConnectionError, ssl.SSLError) as exc:
            log.info("disconnect %s: %s", peer, exc.__class__.__name__)
        except Exception:
            # One peer's failure must never take the daemon (the TaskGroup) down.
            log.exception("connection %s failed", peer)
        finally:
            self._release(slot)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _converse(self, slot: Slot, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = slot.peer
        conn = new_connection(self._token, self._max_frame_bytes)
        frames = ServerReader(reader, conn, self.inbound, self.limits, stream_buffer=2 * READ_BUFFER)
        acks = AckWriter(writer, conn)
        writer.write(conn.send_challenge())
        try:
            # The hello must arrive in time: a silent or trickling peer (slowloris)
            # would otherwise hold a connection slot forever.
            async with asyncio.timeout(self.limits.hello_timeout):
                hello = await self._await_hello(slot, conn, frames, writer)
        except TimeoutError:
            self.counters.refused_peers += 1
            log.warning("refused %s: no hello within %.0f s", peer, self.limits.hello_timeout)
            with contextlib.suppress(Exception):
                writer.write(conn.send_refuse("no hello in time"))
            return
        if hello is None:
            return
        if hello.role == messages.ROLE_CONTROL:
            await self._control_client(peer, conn, hello, frames, writer)
            return
        route = self.routes.open(hello, conn, writer)
        try:
            while await self._take_frame(peer, conn, hello, frames, acks, route):
                pass
        finally:
            if route is not None:
                self.routes.close(route)

    async def _await_hello(
        self, slot: Slot, conn: ServerConnection, frames: ServerReader, writer: asyncio.StreamWriter
    ) -> conv.Hello | None:
        """Read the first frame under the pre-hello cap; accept it if it is a good hello
        and an authenticated slot is free. None once the peer is refused or gone."""
        peer = slot.peer
        events = await frames.first_frame()
        self.counters.frames_received += conn.frames_received
        if not events:
            if not slot.evicted:  # an eviction was said already
                log.info("disconnect %s (before hello)", peer)
            return None
        (event,) = events  # the conversation reads nothing past a hello, good or bad
        if isinstance(event, conv.BadHello):
            if event.oversize:
                self.counters.oversize_frames += 1
            else:
                self.counters.refused_peers += 1
            log.warning("refused %s: %s%s", peer, printable(event.reason), tls_hint(event.declared))
            await self._refuse(conn, writer, event.reason)
            return None
        assert isinstance(event, conv.Hello)
        full = self.gate.authenticate(slot)
        if full is not None:
            self.counters.refused_peers += 1
            log.warning("refused %s (%s): %s", peer, printable(event.sender), full)
            await self._refuse(conn, writer, full)
            return None
        # An agent talking directly resumes after what is stored; relays keep
        # their own resend buffer and learn what is safe from acks.
        last_seq = self._last_seq(event.sender) if event.role == messages.ROLE_AGENT else 0
        self.counters.connections += 1
        log.info("connect %s role=%s sender=%s session=%s", peer, printable(event.role), printable(event.sender),
                 printable(event.session))
        writer.write(conn.send_accept(last_seq))
        await writer.drain()
        return event

    @staticmethod
    async def _refuse(conn: ServerConnection, writer: asyncio.StreamWriter, reason: str) -> None:
        with contextlib.suppress(Exception):
            writer.write(conn.send_refuse(reason))
            await writer.drain()

    async def _control_client(
        self, peer: str, conn: ServerConnection, hello: conv.Hello, frames: ServerReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        """`traceml-daemon profile --daemon`: answer each request until bye or EOF."""
        while True:
            before = conn.frames_received
            try:
                async with frames.frame() as events:
                    self.counters.frames_received += conn.frames_received - before
                    if events is None:
                        return
                    for event in events:
                        if isinstance(event, conv.Request):
                            writer.write(self._answer(conn, event))
                            await writer.drain()
                            continue
                        if isinstance(event, conv.ProtocolFailure):
                            self.counters.protocol_errors += 1
                            log.warning("closing %s (%s): %s", peer, printable(hello.sender), printable(event.reason))
                        return
            except (ReadTimeout, IdleTimeout):
                return

    def _answer(self, conn: ServerConnection, request: conv.Request) -> bytes:
        try:
            sent = self.routes.send(request.session, request.rank, request.steps, request.request_id)
        except RouteError as exc:
            log.warning("profile request %s refused: %s", printable(request.request_id), printable(str(exc)))
            return conn.send_answer(request.request_id, "refused", str(exc))
        log.info("profile request %s: rank %d, %d steps, sent to %s", printable(request.request_id), request.rank,
                 request.steps, printable(sent.sender))
        return conn.send_answer(request.request_id, "sent", f"sent to rank {request.rank}", sent.sender, sent.session)

    async def _take_frame(
        self, peer: str, conn: ServerConnection, hello: conv.Hello, frames: ServerReader, acks: AckWriter,
        route: RoutedConnection | None = None,
    ) -> bool:
        """Read one frame, its body under the inbound budget, and act on it; False once
        the connection must close.

        A method of its own so that nothing of the frame outlives it: as locals of the
        read loop, the last frame's bytes and decoded batch stayed alive while the
        handler waited for its next frame and for budget, about a frame per connection."""
        before = conn.frames_received
        try:
            async with frames.frame() as events:
                self.counters.frames_received += conn.frames_received - before
                if events is None:
                    where = " inside a frame" if conn.in_frame else ""
                    log.info("disconnect %s (%s)%s", peer, printable(hello.sender), where)
                    return False
                for event in events:
                    if not await self._on_event(peer, hello, event, acks, route):
                        return False
                return True
        except ReadTimeout as exc:
            # A stalled frame held budget other peers are waiting for: cut, like a bad frame.
            self.counters.protocol_errors += 1
            log.warning("closing %s (%s): %s", peer, printable(hello.sender), exc)
            return False
        except IdleTimeout as exc:
            log.info("closing %s (%s): %s", peer, printable(hello.sender), exc)
            return False

    async def _on_event(
        self, peer: str, hello: conv.Hello, event: conv.Event, acks: AckWriter, route: RoutedConnection | None = None
    ) -> bool:
        """Act on one event of an accepted peer; False once the connection must close."""
        if isinstance(event, (conv.Batch, conv.RelayBatch)):
            batch = as_batch(hello, event)
            if route is not None:
                self.routes.saw(route, batch.peers)
            return await self._enqueue(hello, batch, acks)
        if isinstance(event, conv.ProtocolFailure):
            if event.oversize:
                self.counters.oversize_frames += 1
            else:
                self.counters.protocol_errors += 1
            log.warning("closing %s (%s): %s", peer, printable(hello.sender), printable(event.reason))
        elif isinstance(event, conv.Bye):
            log.info("bye %s (%s)", peer, printable(hello.sender))
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
