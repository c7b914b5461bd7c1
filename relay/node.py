"""NodeRelay: the loopback server for a node's agents, forwarding upstream.

Per agent connection a ``ServerConnection`` (traceml_wire.server_connection) runs
the conversation: challenge -> hello (role "agent", HMAC on the token) ->
accept(last_seq, with the proof of the token) -> for every ``batch``: hold it,
ack it. Bodies are never unpacked; they travel on as opaque bytes inside
rbatches (see upstream.py).

Two ways to run it:
  * ``async with NodeRelay(...) as relay:`` / ``await relay.serve()`` (tests,
    the standalone ``traceml-relay``);
  * ``start_relay_thread(...)`` from the agent of local rank 0: the relay's
    loop runs on a daemon thread beside training, so a slow daemon can never
    block the training thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import tempfile
import threading
from typing import Any

from relay._frames import ConnectionClosed, Wire
from relay._loop import new_event_loop
from relay.limits import RELAY_LIMITS
from relay.upstream import (
    DEFAULT_BUFFER_BYTES,
    DEFAULT_FLUSH_INTERVAL,
    DEFAULT_SPOOL_BYTES,
    Upstream,
    warn,
)
from traceml_wire import MAX_AGENT_FRAME_BYTES, ProtocolError
from traceml_wire import connection_events as conv
from traceml_wire import messages as wm
from traceml_wire.addresses import is_loopback
from traceml_wire.aio import ByteBudget, IdleTimeout, ReadTimeout, ServerReader
from traceml_wire.limits import ConnectionGate, ConnectionLimits, set_keepalive
from traceml_wire.printable import printable
from traceml_wire.ratelimit import LineLimiter
from traceml_wire.server_connection import ServerConnection

DEFAULT_PORT = 29766
DEFAULT_DAEMON = ("127.0.0.1", 29765)
HELLO_TIMEOUT = RELAY_LIMITS.hello_timeout
# An agent connection's stream buffer: the transport stops reading the socket once it
# holds twice this; a frame's body beyond it is read under the inbound byte budget.
READ_BUFFER = 64 * 1024
# Derived in traceml_wire from the daemon's cap: every body the agent may send passes,
# and one alone in an rbatch still fits the daemon's frame cap.
AGENT_MAX_FRAME_BYTES = MAX_AGENT_FRAME_BYTES


def default_spool_dir(session: str) -> str:
    """TRACEML_SPOOL_DIR, else a per-session directory under the temp dir."""
    configured = os.environ.get("TRACEML_SPOOL_DIR")
    if configured:
        return configured
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in session)[:100] or "default"
    return os.path.join(tempfile.gettempdir(), "traceml-spool", safe)


def parse_hostport(value: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) to a tuple; ValueError with a clear message."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port, got {value!r}")
    return host.strip("[]"), int(port)



class NodeRelay:
    def __init__(
        self,
        *,
        port: int = DEFAULT_PORT,
        upstream: tuple[str, int] = DEFAULT_DAEMON,
        token: str | None = None,
        session: str,
        node: dict[str, Any],
        spool_dir: str | None = None,
        host: str = "127.0.0.1",
        tls_ca: str | None = None,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        spool_bytes: int = DEFAULT_SPOOL_BYTES,
        flush_interval: float = DEFAULT_FLUSH_INTERVAL,
        hello_timeout: float | None = None,
        max_frame_bytes: int = AGENT_MAX_FRAME_BYTES,
        limits: ConnectionLimits = RELAY_LIMITS,
    ) -> None:
        if not token and not is_loopback(host):
            # Anyone on the network could inject telemetry: refuse at start.
            raise ValueError(f"refusing to listen on non-loopback {host} without a token")
        if hello_timeout is not None:
            limits = dataclasses.replace(limits, hello_timeout=hello_timeout)
        self.host = host
        self.port = port
        self._token = token
        self.limits = limits
        self.max_frame_bytes = max_frame_bytes
        # Agent connection slots (authenticated and not) and the bytes of frames being read.
        self.gate: ConnectionGate[asyncio.StreamWriter] = ConnectionGate(limits)
        self.inbound = ByteBudget(limits.inbound_bytes)
        # What a peer can make the relay say, repeated, on the stderr of the trainer that embeds it.
        self._lines = LineLimiter()
        self.upstream = Upstream(
            daemon=upstream,
            token=token,
            session=session,
            node=node,
            spool_dir=spool_dir,
            buffer_bytes=buffer_bytes,
            spool_bytes=spool_bytes,
            flush_interval=flush_interval,
            tls_ca=tls_ca,
            limits=limits,
        )
        self.stats = self.upstream.stats
        self._held: dict[str, int] = {}  # agent sender -> highest seq held (dedup high-water)
        # Agent sender -> its open connection: where the daemon's control requests go.
        self._agents: dict[str, Wire] = {}
        self.upstream.on_control = self._route_control
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._wires: set[Wire] = set()
        self._main: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()
        self._closing = False

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Bind the agent port (raises OSError if taken) and start forwarding."""
        backlog = max(100, self.limits.max_connections + self.limits.max_unauthenticated)
        self._server = await asyncio.start_server(
            self._on_agent, self.host, self.port, limit=READ_BUFFER, backlog=backlog
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._main = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.upstream.run())
            tg.create_task(self.upstream.packer())

    async def serve(self) -> None:
        """Start (if needed) and run until ``aclose`` is called."""
        if self._server is None:
            await self.start()
        await self._stopped.wait()

    async def aclose(self, timeout: float = 2.0, agent_grace: float = 0.0) -> None:
        """Stop taking agents, flush what is held upstream within ``timeout``, close.

        ``agent_grace``: first wait up to this long for connected agents to say
        bye on their own. An embedded relay stops when its host rank exits, and
        the node's other ranks may still be sending their final batches.
        """
        if self._closing:
            await self._stopped.wait()
            return
        grace_end = asyncio.get_running_loop().time() + agent_grace
        while self.stats.agents_connected > 0 and asyncio.get_running_loop().time() < grace_end:
            await asyncio.sleep(0.05)
        self._closing = True
        try:
            if self._server is not None:
                self._server.close()
            # Abort the agent sockets rather than cancel their tasks: each handler then
            # ends through its normal ConnectionClosed path (asyncio logs cancelled
            # start_server callbacks as errors).
            for wire in list(self._wires):
                wire.writer.transport.abort()
            await asyncio.gather(*self._connections, return_exceptions=True)
            await self.upstream.flush_for_stop(timeout)
            if self.upstream.unacked and self.upstream.spool is None:
                warn(f"stopping with {self.upstream.unacked} rbatch(es) not acknowledged by the daemon")
            await self.upstream.say_bye()
            if self._main is not None:
                self._main.cancel()
                await asyncio.gather(self._main, return_exceptions=True)
            self.upstream.close()
        finally:
            self._stopped.set()

    async def __aenter__(self) -> NodeRelay:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def statistics(self) -> dict[str, Any]:
        out: dict[str, Any] = self.stats.as_dict()
        out.update(dataclasses.asdict(self.upstream.control_stats))
        out["upstream_connected"] = self.upstream.connected
        out["unacked_rbatches"] = self.upstream.unacked
        out["memory_bytes"] = self.upstream.memory_bytes
        out["spool_bytes"] = self.upstream.spool.live_bytes if self.upstream.spool else 0
        return out

    # ------------------------------------------------------------ agents

    def _say(self, kind: str, message: str) -> None:
        """A warning a peer can repeat at will: the first of its kind, then one a minute."""
        line = self._lines.line(kind, message)
        if line is not None:
            warn(line)

    async def _on_agent(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Track the connection task so aclose() can end it.
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)
        if self._closing:
            writer.transport.abort()
            return
        set_keepalive(writer.get_extra_info("socket"), self.limits.keepalive)
        peer = writer.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)
        admission = self.gate.admit(writer, host)
        for victim in admission.evict:
            # Aborted, not cancelled: its handler ends through its own EOF path.
            self.stats.refused_agents += 1
            self._say("refused", "refused an agent: no hello yet and its slot went to a newer connection")
            victim.transport.abort()
        try:
            if not admission.admitted:
                self.stats.refused_agents += 1
                self._say("refused", f"refused an agent: {admission.reason}")
                wire = Wire(reader, writer, ServerConnection(None))
                await self._refuse_now(wire, admission.reason)
                await wire.close()
                return
            await self._agent(reader, writer)
        finally:
            self.gate.release(writer)

    async def _agent(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # The conversation reads only a hello-sized frame until the hello is accepted
        # (an agent sends nothing else before its accept); then the full agent frame cap.
        conn = ServerConnection(
            self._token, roles=frozenset({wm.ROLE_AGENT}), max_frame_bytes=self.max_frame_bytes
        )
        wire = Wire(reader, writer, conn)
        frames = ServerReader(reader, conn, self.inbound, self.limits, stream_buffer=2 * READ_BUFFER)
        self._wires.add(wire)
        sender: str | None = None
        try:
            sender = await self._handshake(wire, frames)
            if sender is None:
                return
            self.stats.agents_connected += 1
            self._agents[sender] = wire  # a reconnect replaces an older connection of the same sender
            try:
                await self._receive_batches(wire, frames, sender)
            finally:
                self.stats.agents_connected -= 1
                if self._agents.get(sender) is wire:
                    del self._agents[sender]
        except ConnectionClosed:
            pass
        except ProtocolError as exc:
            # One bad agent loses its connection; every other agent carries on.
            self.stats.agent_protocol_errors += 1
            self._say("closing", f"closing agent connection ({printable(sender or 'before hello')}): "
                                 f"{printable(exc)}")
        except (OSError, ConnectionError):
            pass
        finally:
            self._wires.discard(wire)
            await wire.close()

    async def _handshake(self, wire: Wire, frames: ServerReader) -> str | None:
        await wire.send(wire.conn.send_challenge())
        try:
            async with asyncio.timeout(self.limits.hello_timeout):
                events = await frames.first_frame()
        except TimeoutError:
            return await self._refuse(wire, "no hello within the timeout")
        if not events:
            if wire.conn.in_frame:
                return await self._refuse(wire, "bad hello: stream ended inside a frame")
            return None
        (event,) = events  # the conversation reads nothing past a hello, good or bad
        if not isinstance(event, conv.Hello):
            assert isinstance(event, conv.BadHello)
            return await self._refuse(wire, event.reason)
        full = self.gate.authenticate(wire.writer)
        if full is not None:
            return await self._refuse(wire, full)
        self.upstream.peers[event.sender] = event.identity
        await wire.send(wire.conn.send_accept(self._held.get(event.sender, 0)))
        return event.sender

    def _route_control(self, control: conv.Control) -> None:
        """A request from the daemon, down to the one agent it names (never to any other)."""
        wire = self._agents.get(control.sender)
        hello = wire.conn.hello if wire is not None else None
        if wire is None or hello is None or wm.CAP_CONTROL not in hello.caps or wire.writer.is_closing():
            self.upstream.control_stats.controls_dropped += 1  # the CLI then reports that no trace arrived
            return
        # One write of one small frame: it never interleaves with an ack's frame.
        wire.writer.write(wire.conn.send_control(control.op, control.sender, control.steps, control.request_id))
        self.upstream.control_stats.controls_forwarded += 1

    async def _refuse(self, wire: Wire, reason: str) -> None:
        self.stats.refused_agents += 1
        self._say("refused", f"refused an agent: {printable(reason)}")
        await self._refuse_now(wire, reason)
        return None

    @staticmethod
    async def _refuse_now(wire: Wire, reason: str) -> None:
        try:
            await asyncio.wait_for(wire.send(wire.conn.send_refuse(reason)), 1.0)
        except (TimeoutError, OSError, ConnectionError, RuntimeError):
            pass  # the peer is gone (uvloop raises RuntimeError on a closed transport)

    async def _receive_batches(self, wire: Wire, frames: ServerReader, sender: str) -> None:
        while True:
            try:
                ack = await self._take_frame(frames, sender)
            except ReadTimeout as exc:
                # A stalled frame holds budget the node's other agents wait for: cut it.
                raise ProtocolError(str(exc)) from None
            except IdleTimeout:
                return  # a quiet agent reconnects when it has something to send
            if ack is None:
                return
            # Waiting for the ack to drain before taking the next frame is the
            # per-connection backpressure: a stalled agent socket stops our reads.
            await wire.send(wire.conn.send_ack(ack))

    async def _take_frame(self, frames: ServerReader, sender: str) -> int | None:
        """One frame into the buffer, under the inbound budget: the seq to ack, None
        when the agent is done (bye or EOF between frames)."""
        async with frames.frame() as events:
            if events is None:
                if frames.conn.in_frame:
                    raise ProtocolError("stream ended inside a frame")
                return None
            seq: int | None = None
            for event in events:
                if isinstance(event, conv.Bye):
                    return None
                if not isinstance(event, conv.Batch):
                    assert isinstance(event, conv.ProtocolFailure)
                    raise ProtocolError(event.reason)
                seq = event.seq
                if seq <= self._held.get(sender, 0):
                    self.stats.duplicate_batches += 1  # resent after a reconnect; already held
                else:
                    self.upstream.put(sender, seq, event.body)
                    self._held[sender] = seq
            return seq


# ---------------------------------------------------------------- thread API


# A relay embedded in a training process keeps little in memory and spills the
# rest to its spool, so an unreachable daemon does not grow the trainer's RSS.
EMBEDDED_BUFFER_BYTES = 8 * 1024 * 1024


class RelayHandle:
    """A relay running on its own daemon thread (see ``start_relay_thread``)."""

    def __init__(self, relay: NodeRelay, loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
        self._relay = relay
        self._loop = loop
        self._thread = thread
        self.port = relay.port

    def stop(self, timeout: float = 2.0, agent_grace: float = 10.0) -> None:
        """Wait up to ``agent_grace`` s for the node's other agents to finish, flush
        held data upstream for at most ``timeout`` s, then close."""
        if not self._thread.is_alive():
            return
        try:
            future = asyncio.run_coroutine_threadsafe(self._relay.aclose(timeout, agent_grace), self._loop)
            future.result(timeout + agent_grace + 2.0)
        except Exception as exc:  # never raise into the training process at exit
            warn(f"relay stop: {exc!r}")
        self._thread.join(timeout + 2.0)

    def statistics(self) -> dict[str, Any]:
        return dict(self._relay.statistics())

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


def start_relay_thread(
    *,
    port: int,
    upstream: tuple[str, int],
    token: str | None,
    session: str,
    node: dict[str, Any],
    spool_dir: str | None = None,
    buffer_bytes: int = EMBEDDED_BUFFER_BYTES,
    tls_ca: str | None = None,
) -> RelayHandle:
    """Run a NodeRelay on a daemon thread; return once its port is bound.

    Raises OSError (quickly) when the port is taken, e.g. by another process's
    relay on this node, or when ``tls_ca`` (the CA file that verifies the daemon's
    TLS certificate) cannot be read; the caller decides what that means.
    """
    ready = threading.Event()
    outcome: dict[str, Any] = {}
    loop = new_event_loop()

    async def main() -> None:
        try:
            relay = NodeRelay(
                port=port,
                upstream=upstream,
                token=token,
                session=session,
                node=node,
                spool_dir=spool_dir or default_spool_dir(session),
                buffer_bytes=buffer_bytes,
                tls_ca=tls_ca,
            )
            await relay.start()
        except BaseException as exc:
            outcome["error"] = exc
            ready.set()
            return
        outcome["relay"] = relay
        ready.set()
        await relay.serve()

    def target() -> None:
        try:
            loop.run_until_complete(main())
        finally:
            loop.close()

    thread = threading.Thread(target=target, name="traceml-relay", daemon=True)
    thread.start()
    ready.wait()
    if "error" in outcome:
        thread.join()
        raise outcome["error"]
    return RelayHandle(outcome["relay"], loop, thread)
