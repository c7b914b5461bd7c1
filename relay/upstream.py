"""The relay's single connection to the daemon, and everything it must not lose.

Agent batches arrive as ``[sender, seq, body]`` items (bodies stay opaque
bytes). They are packed into numbered ``rbatch`` messages about once per flush
interval, or sooner when ~1 MiB is pending. Every rbatch stays in the unacked
buffer until the daemon acks it (acks are cumulative); after a reconnect the
whole buffer is resent in order, and the daemon discards what it already
stored (it dedups by agent sender/seq), which gives at-least-once delivery
without duplicates in the database.

Buffer = spool (oldest, on disk, optional) followed by memory (newest), all in
rbatch seq order. When memory exceeds its byte cap the oldest rbatches spill to
the spool, or, without a spool, are dropped and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, NoReturn

from relay._frames import ConnectionClosed, Wire
from relay.backoff import Backoff
from relay.limits import RELAY_LIMITS
from relay.spool_file import Packed, Spool
from traceml_wire import ProtocolError, encode_frame, pack_message
from traceml_wire import connection_events as conv
from traceml_wire import messages as wm
from traceml_wire.client_connection import ClientConnection
from traceml_wire.connection import State
from traceml_wire.framing import MAX_RBATCH_ITEMS
from traceml_wire.limits import ConnectionLimits, set_keepalive
from traceml_wire.printable import printable

DEFAULT_BUFFER_BYTES = 256 * 1024 * 1024
DEFAULT_SPOOL_BYTES = 1024 * 1024 * 1024
FLUSH_BYTES = 1024 * 1024
DEFAULT_FLUSH_INTERVAL = 0.25  # a hop of at most this much on step end to visible (p99 <= 1.5 s)
CONNECT_TIMEOUT = 5.0


@dataclass
class RelayStats:
    """Counters sent upstream in every rbatch ``stats`` (cumulative, except
    ``agents_connected`` which is the current number of agent connections).

    Batch counts are agent batches (rbatch items), not rbatches.
    """

    dropped_batches: int = 0  # lost for good: memory overflow without spool, plus spool_dropped_batches
    dropped_bytes: int = 0  # agent body bytes of those
    spooled_batches: int = 0  # written to the spool
    spool_dropped_batches: int = 0  # dropped from the spool (cap or a bad record)
    agents_connected: int = 0
    refused_agents: int = 0  # hellos refused (bad token, role, version) or timed out
    agent_protocol_errors: int = 0  # agent connections closed for a bad frame/message
    received_batches: int = 0  # agent batches accepted into the buffer
    duplicate_batches: int = 0  # agent batches resent after a reconnect, skipped
    rbatches_sent: int = 0
    rbatches_acked: int = 0
    upstream_connects: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class ControlStats:
    """Control requests from the daemon (this process's own counts; the relay's
    ``statistics()`` shows them, rbatches do not carry them)."""

    controls_forwarded: int = 0  # passed down to their agent
    controls_dropped: int = 0  # for an agent not connected here, or one that cannot take them
    controls_refused: int = 0  # malformed control messages from the daemon


class DaemonRefused(ConnectionError):
    """The daemon answered this relay's hello with refuse (a token mismatch, most often)."""


class DaemonUnverified(ConnectionError):
    """What answered on the daemon's address accepted without proving it holds the token."""


def warn(message: str) -> None:
    """Relay diagnostics go to stderr with a fixed prefix (never the token)."""
    print(f"[traceml] relay: {message}", file=sys.stderr, flush=True)


class Upstream:
    def __init__(
        self,
        *,
        daemon: tuple[str, int],
        token: str | None,
        session: str,
        node: dict[str, Any],
        spool_dir: str | None,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        spool_bytes: int = DEFAULT_SPOOL_BYTES,
        flush_interval: float = DEFAULT_FLUSH_INTERVAL,
        tls_ca: str | None = None,
        backoff: Backoff | None = None,
        limits: ConnectionLimits = RELAY_LIMITS,
    ) -> None:
        self.daemon = daemon
        self.limits = limits  # its keepalive settings apply to the daemon link
        self._token = token
        self.session = session
        self.node = wm.clean_identity(node)
        node_rank = self.node.get("node_rank", 0)
        self.sender = f"relay/{session}/n{node_rank}/{os.getpid()}-{os.urandom(3).hex()}"
        self.stats = RelayStats()
        self.control_stats = ControlStats()
        self.buffer_bytes = buffer_bytes
        self.flush_interval = flush_interval
        self._ssl = ssl.create_default_context(cafile=tls_ca) if tls_ca else None
        self._backoff = backoff or Backoff()
        self.spool = Spool(spool_dir, spool_bytes) if spool_dir and spool_bytes > 0 else None
        # Highest rbatch seq the spool cap dropped. Dropped records stay on disk until their
        # whole segment goes, so rbatches say it: ``traceml-daemon ingest`` must not store
        # what this relay already counted as lost.
        self._spool_dropped_upto = 0
        # Items not yet packed, and the identity each agent sender gave in its hello.
        self._pending: list[list[Any]] = []
        self._pending_bytes = 0
        self.peers: dict[str, dict[str, Any]] = {}
        # Packed, unacked rbatches kept in memory (newest part of the buffer).
        self._memory: deque[Packed] = deque()
        self._memory_bytes = 0
        self._next_seq = 1
        self._acked = 0
        self._changed = asyncio.Event()  # new data to send, or an ack arrived
        self.connected = False
        # True once a connection attempt failed, until one succeeds: a stop then
        # spools at once instead of waiting for acks that cannot come.
        self.unreachable = False
        self._retry_now = asyncio.Event()
        self._attempt_failed = asyncio.Event()
        self._wire: Wire | None = None
        self._said_bye = False
        self._warned: set[str] = set()
        # Where a control request from the daemon goes (NodeRelay routes it to its agent).
        self.on_control: Callable[[conv.Control], None] = lambda control: None

    # ------------------------------------------------------------ intake

    def put(self, sender: str, seq: int, body: bytes) -> None:
        """Hold one agent batch (the relay acks the agent right after this)."""
        if self._pending_bytes + len(body) > FLUSH_BYTES and self._pending:
            self.pack()  # keep every rbatch near FLUSH_BYTES, far below the frame cap
        self._pending.append([sender, seq, body])
        self._pending_bytes += len(body)
        self.stats.received_batches += 1
        # The daemon decodes an rbatch within limits sized on MAX_RBATCH_ITEMS items.
        if self._pending_bytes >= FLUSH_BYTES or len(self._pending) >= MAX_RBATCH_ITEMS:
            self.pack()

    def pack(self) -> None:
        """Turn the pending items into one numbered rbatch in the buffer."""
        if not self._pending:
            return
        items, self._pending = self._pending, []
        body_bytes, self._pending_bytes = self._pending_bytes, 0
        peers = {s: self.peers.get(s, {}) for s in {item[0] for item in items}}
        # Make room *before* taking the stats snapshot, so the rbatch that caused
        # a drop also reports it (the last rbatch before shutdown included).
        estimate = body_bytes + sum(len(item[0]) + 16 for item in items) + sum(len(p) + 256 for p in peers) + 1024
        self._evict(estimate)
        self._push(self._numbered(items, peers, self.stats.as_dict(), body_bytes))

    def _numbered(
        self, items: list[list[Any]], peers: dict[str, dict[str, Any]], stats: dict[str, int], body_bytes: int
    ) -> Packed:
        """The next rbatch seq, packed with ``stats`` (a snapshot: taken by the caller)."""
        seq = self._next_seq
        self._next_seq += 1
        # ``sender`` rides along so a spooled rbatch names its relay: ``traceml-daemon
        # ingest`` then stores these stats under the same source as the live ones.
        data = pack_message(
            wm.relay_batch(
                seq, items, peers, self.node, stats, sender=self.sender, spool_dropped_upto=self._spool_dropped_upto
            )
        )
        return Packed(seq, data, len(items), body_bytes)

    def _push(self, packed: Packed) -> None:
        self._memory.append(packed)
        self._memory_bytes += len(packed.data)
        self._evict(0, keep=1)  # the estimate in pack() was low; keep the newest regardless
        self._changed.set()

    def _evict(self, incoming: int, keep: int = 0) -> None:
        """Spill (or drop) the oldest in-memory rbatches until ``incoming`` more bytes fit."""
        while self._memory_bytes + incoming > self.buffer_bytes and len(self._memory) > keep:
            old = self._memory.popleft()
            self._memory_bytes -= len(old.data)
            if self.spool is not None:
                try:
                    self.spool.append(old)
                    self._note_cap_drops()
                    self.stats.spooled_batches += old.n_items
                except OSError as exc:
                    self._warn_once("spool-write", f"cannot write spool in {self.spool.directory}: {exc}; dropping")
                    self._count_drop(old)
                self._collect_spool_drops()
            else:
                self._count_drop(old)

    def _count_drop(self, packed: Packed) -> None:
        self.stats.dropped_batches += packed.n_items
        self.stats.dropped_bytes += packed.body_bytes

    def _note_cap_drops(self) -> None:
        """Right after an append, ``spool.dropped`` holds only what its cap pushed out (the
        oldest records; read-back drops of corrupt ones are collected where they happen)."""
        assert self.spool is not None
        for packed in self.spool.dropped:
            self._spool_dropped_upto = max(self._spool_dropped_upto, packed.seq)

    def _collect_spool_drops(self) -> None:
        if self.spool is None:
            return
        for packed in self.spool.dropped:
            self.stats.spool_dropped_batches += packed.n_items
            self._count_drop(packed)
        self.spool.dropped.clear()

    # ------------------------------------------------------------ buffer view

    @property
    def unacked(self) -> int:
        """rbatches held (spool + memory) and not acked yet, plus one if items are pending."""
        return len(self._memory) + (len(self.spool) if self.spool else 0) + (1 if self._pending else 0)

    @property
    def memory_bytes(self) -> int:
        return self._memory_bytes

    def _next_after(self, seq: int) -> Packed | None:
        """The oldest buffered rbatch with a seq above ``seq`` (spool first)."""
        if self.spool is not None and len(self.spool):
            found = self.spool.next_after(seq)
            self._collect_spool_drops()
            if found is not None:
                return found
        if not self._memory:
            return None
        # Memory seqs are contiguous (spills, drops and acks all leave from the left).
        index = max(0, seq + 1 - self._memory[0].seq)
        return self._memory[index] if index < len(self._memory) else None

    def ack(self, seq: int) -> None:
        if seq <= self._acked:
            return
        self.stats.rbatches_acked += seq - self._acked
        self._acked = seq
        if self.spool is not None:
            self.spool.ack(seq)
        while self._memory and self._memory[0].seq <= seq:
            self._memory_bytes -= len(self._memory.popleft().data)
        self._changed.set()

    async def flush_for_stop(self, timeout: float) -> None:
        """Wait (at most ``timeout``) for the daemon to ack everything held. While
        the daemon is unreachable, make one immediate attempt instead of waiting
        out the backoff, and give up as soon as it fails: a trainer's exit must
        not wait for a daemon that is down (close() spools what is left)."""
        waits = [asyncio.ensure_future(self.wait_drained())]
        if self.unreachable:
            self._attempt_failed.clear()
            self._retry_now.set()
            waits.append(asyncio.ensure_future(self._attempt_failed.wait()))
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def wait_drained(self) -> None:
        """Return once every held batch has been acked by the daemon."""
        self.pack()
        while self.unacked:
            self._changed.clear()
            await self._changed.wait()

    # ------------------------------------------------------------ tasks

    async def packer(self) -> None:
        """Pack pending items about once per flush interval."""
        while True:
            await asyncio.sleep(self.flush_interval)
            self.pack()

    async def run(self) -> None:
        """Keep one daemon connection up; resend the unacked buffer after each reconnect,
        until the stream ended with a bye."""
        while not self._said_bye:
            try:
                await self._connect_and_stream()
            except ConnectionClosed as exc:
                if not (self.connected and not self.unacked):
                    self.unreachable = True
                    self._warn_once(*self._describe(exc))
                # Else the daemon closed a link that had nothing in flight (its idle timeout):
                # reconnect without a word; a daemon that is really gone fails that attempt.
            except (TimeoutError, OSError, ConnectionError, ProtocolError, EOFError) as exc:
                self.unreachable = True
                self._warn_once(*self._describe(exc))
            except Exception as exc:  # a bug must not silently end forwarding for the whole node
                self._warn_once(f"bug-{type(exc).__name__}", f"unexpected error on the daemon connection: {exc!r}; retrying")
            finally:
                self.connected = False
            self._attempt_failed.set()
            # Back off, but a stop cuts the wait short for one last attempt.
            # asyncio.timeout, not wait_for: on 3.11 wait_for drops a cancellation that arrives
            # as its inner wait completes, and a stopping relay then never ends this task.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._backoff.next_delay()):
                    await self._retry_now.wait()
            self._retry_now.clear()

    def _describe(self, exc: BaseException) -> tuple[str, str]:
        """The warning key and line for a failed or lost daemon connection."""
        daemon = f"daemon {self.daemon[0]}:{self.daemon[1]}"
        where = f"; buffering, then spooling under {self.spool.directory}" if self.spool else ""
        if isinstance(exc, DaemonUnverified):
            return "unverified", (f"{daemon} did not prove it holds TRACEML_TOKEN ({exc}); nothing is forwarded "
                                  f"to it; retrying{where}")
        if isinstance(exc, DaemonRefused):
            # A full daemon refuses too: the token is worth checking only when the reason says so.
            hint = "check that both hold the same TRACEML_TOKEN; " if "token" in str(exc) else ""
            return "refused", f"{daemon} refused this relay: {printable(exc)}; {hint}retrying{where}"
        return "unreachable", (f"{daemon} unreachable or dropped: {printable(repr(exc))}{self._tls_hint(exc)}; "
                               f"retrying{where}")

    def _tls_hint(self, exc: BaseException) -> str:
        """Name the settings to check when TLS itself failed: retrying cannot fix those."""
        if self._ssl is None or not isinstance(exc, ssl.SSLError):
            return ""
        return " (TLS failed: the daemon must serve a --tls-cert signed by the CA in TRACEML_TLS_CA / --tls-ca)"

    async def _connect_and_stream(self) -> None:
        host, port = self.daemon
        async with asyncio.timeout(CONNECT_TIMEOUT):  # not wait_for: see run()
            reader, writer = await asyncio.open_connection(
                host, port, ssl=self._ssl, server_hostname=host if self._ssl else None
            )
        set_keepalive(writer.get_extra_info("socket"), self.limits.keepalive)
        wire = Wire(reader, writer, ClientConnection(self._token))
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                last_seq = await self._handshake(wire)
            self.ack(last_seq)
            self.connected = True
            self.unreachable = False
            self.stats.upstream_connects += 1
            self._backoff.reset()
            self._warned.clear()  # a later outage deserves a fresh message
            self._wire = wire
            # Either half failing ends the connection; the other is cancelled and
            # the first cause propagates as a plain exception for run() to classify.
            tasks = [asyncio.ensure_future(self._read_acks(wire)), asyncio.ensure_future(self._send_all(wire))]
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            for task in done:
                task.result()
        finally:
            self._wire = None
            await wire.close()

    async def _handshake(self, wire: Wire) -> int:
        """Challenge, hello, accept with the daemon's proof of the token; its last_seq."""
        while True:
            for event in await wire.events():
                if isinstance(event, conv.Challenge):
                    identity = {**self.node, "pid": os.getpid()}
                    await wire.send(wire.conn.send_hello(role=wm.ROLE_RELAY, sender=self.sender,
                                                         session=self.session, identity=identity,
                                                         caps=(wm.CAP_CONTROL,)))
                elif isinstance(event, conv.Accepted):
                    return event.last_seq
                else:
                    self._fail(event)

    @staticmethod
    def _fail(event: conv.Event) -> NoReturn:
        if isinstance(event, conv.Refused):
            raise DaemonRefused(event.reason)
        if isinstance(event, conv.Unverified):
            raise DaemonUnverified(event.reason)
        raise ProtocolError(getattr(event, "reason", f"unexpected {type(event).__name__} from the daemon"))

    async def _send_all(self, wire: Wire) -> None:
        sent = self._acked  # everything above the ack is resent on a new connection
        while True:
            packed = self._next_after(sent)
            if packed is None or wire.conn.state is not State.OPEN:  # not after say_bye
                self._changed.clear()
                await self._changed.wait()
                continue
            await wire.send(wire.conn.send_encoded(packed.seq, encode_frame(packed.data)))
            self.stats.rbatches_sent += 1
            sent = packed.seq

    async def _read_acks(self, wire: Wire) -> None:
        while True:
            for event in await wire.events():
                if isinstance(event, conv.Control):
                    self.on_control(event)
                    continue
                if isinstance(event, conv.ControlRefused):
                    self.control_stats.controls_refused += 1
                    continue
                if not isinstance(event, conv.Ack):
                    self._fail(event)
                self.ack(event.seq)

    async def say_bye(self) -> None:
        """Tell the daemon this is a clean end of stream (best effort)."""
        self._said_bye = True  # the daemon closes after a bye: no reconnect to race the stop
        wire = self._wire
        if wire is not None and self.connected and wire.conn.state is State.OPEN:
            try:
                await asyncio.wait_for(wire.send(wire.conn.send_bye()), 0.5)
            except (TimeoutError, OSError, ConnectionError):
                pass

    def close(self) -> None:
        """Final step of a stop: whatever the daemon has not acked goes to the spool
        and stays on disk (for a later ``traceml-daemon ingest``); without a spool
        it is dropped and counted."""
        self.pack()
        if self.spool is None:
            for packed in self._memory:
                self._count_drop(packed)
        else:
            dropped = self.stats.dropped_batches
            self._evict(self.buffer_bytes + 1)  # spill every in-memory rbatch
            if self.stats.dropped_batches != dropped:
                self._spool_final_stats()
            kept = self.spool.close(keep_unacked=True)
            # One line per process: when the daemon was reported unreachable (or
            # refused, or unverified), that line already named the spool directory.
            if kept and not self._warned & {"unreachable", "refused", "unverified"}:
                warn(f"daemon did not acknowledge everything; unsent data kept in {len(kept)} spool file(s) under {self.spool.directory}")
        self._memory.clear()
        self._memory_bytes = 0

    def _spool_final_stats(self) -> None:
        """The spill at stop pushed the spool over its cap: records were dropped after
        the last rbatch took its stats snapshot, and no rbatch would report them. One
        more rbatch, without items, carries the final counters into the spool for
        ``traceml-daemon ingest``. Writing it may displace another old record, which
        changes the counters again: repeat (a few rounds at most; each is ~1 KiB)."""
        assert self.spool is not None
        for _ in range(8):
            before = self.stats.as_dict()
            try:
                self.spool.append(self._numbered([], {}, before, 0))
            except OSError:
                return  # already warned about the spool; the counters stay in this process only
            self._note_cap_drops()
            self._collect_spool_drops()
            if self.stats.as_dict() == before:
                return

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warn(message)

