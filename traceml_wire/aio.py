"""The asyncio pieces both servers share: the relay (for its agents) and the daemon.

The one module of ``traceml_wire`` that imports asyncio. The sans-I/O modules
never import it and ``import traceml_wire`` does not load it; it exists so that
the relay, which must not import ``traceml_daemon``, and the daemon read their
peers with one implementation of the same discipline:

``ByteBudget``: frames read from sockets but not yet handed on, across every
connection of a server. A connection reserves a frame's bytes before it reads
the body and gives them back once the frame is handed on (or dropped), so a
server holds a bounded amount however many peers are sending.

``ServerReader``: one peer's frames, header first, under a ``ServerConnection``
and the server's ``ConnectionLimits``: the first frame (the hello) outside the
budget and under the pre-hello cap; every later one within the idle timeout of
the previous, its bytes reserved before the bulk of its body is read and its
body complete within the read timeout, or the peer is cut and the reservation
released. The first part of a body, as much as the connection's stream buffer
holds anyway, is read before the reservation: a peer that declares a large
frame and stalls before delivering that much holds no budget at all, so it
cannot make the others wait for its read timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator

from traceml_wire.connection_events import Event
from traceml_wire.framing import HEADER_BYTES
from traceml_wire.limits import ConnectionLimits
from traceml_wire.server_connection import ServerConnection


class ByteBudget:
    """A semaphore counted in bytes. ``hold(n)`` waits until ``n`` more bytes fit
    under ``max_bytes`` (one request larger than the whole budget is let through
    alone, else it would wait forever) and gives them back on exit.

    Waiters are served first come, first served: a big frame is not starved by a
    stream of small ones."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        self.max_bytes = max_bytes
        self._held = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        self.peak_bytes = 0
        self.waits = 0  # holds that had to wait for bytes

    @property
    def bytes_held(self) -> int:
        return self._held

    def _fits(self, nbytes: int) -> bool:
        return self._held == 0 or self._held + nbytes <= self.max_bytes

    @contextlib.asynccontextmanager
    async def hold(self, nbytes: int) -> AsyncIterator[None]:
        await self._acquire(nbytes)
        try:
            yield
        finally:
            self._release(nbytes)

    async def _acquire(self, nbytes: int) -> None:
        if not self._waiters and self._fits(nbytes):
            self._take(nbytes)
            return
        self.waits += 1
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (nbytes, waiter)
        self._waiters.append(entry)
        try:
            await waiter  # _wake takes the bytes for us before resolving it
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._release(nbytes)  # granted, then cancelled before we could use it
            else:
                with contextlib.suppress(ValueError):  # _wake may have dropped it already
                    self._waiters.remove(entry)
                self._wake()  # we may have been the head blocking smaller requests
            raise

    def _take(self, nbytes: int) -> None:
        self._held += nbytes
        self.peak_bytes = max(self.peak_bytes, self._held)

    def _release(self, nbytes: int) -> None:
        self._held -= nbytes
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            nbytes, waiter = self._waiters.popleft()
            if waiter.done():
                continue
            self._take(nbytes)
            waiter.set_result(None)

    def statistics(self) -> dict[str, int]:
        return {"bytes_held": self._held, "max_bytes": self.max_bytes, "peak_bytes": self.peak_bytes,
                "waiters": len(self._waiters), "waits": self.waits}


class IdleTimeout(TimeoutError):
    """An authenticated peer sent no frame within the idle timeout."""


class ReadTimeout(TimeoutError):
    """A frame's body did not arrive whole within the read timeout."""


class ServerReader:
    """Reads one peer's frames into its ``ServerConnection``, one frame per step and
    never a byte beyond it, so the frame after an accepted hello meets the full cap,
    not the pre-hello one."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        conn: ServerConnection,
        budget: ByteBudget,
        limits: ConnectionLimits,
        stream_buffer: int,
    ) -> None:
        """``stream_buffer``: what ``reader`` buffers before it stops reading the socket
        (twice its limit); that much of a body is read before the budget is asked."""
        self.reader = reader
        self.conn = conn
        self.budget = budget
        self.limits = limits
        self.stream_buffer = stream_buffer

    async def first_frame(self) -> list[Event] | None:
        """The peer's first frame (its hello): under the pre-hello cap and outside the
        budget, so the caller bounds it with the hello timeout. None at EOF."""
        events = await self._header()
        if events == []:
            events = await self._body()
        return events

    @contextlib.asynccontextmanager
    async def frame(self) -> AsyncIterator[list[Event] | None]:
        """The next frame of an accepted peer: its events, None at EOF. The frame's
        bytes stay reserved until the ``async with`` block ends, so the caller hands
        the frame on inside it. Raises IdleTimeout or ReadTimeout (the reservation
        is released) for a peer that is to be cut."""
        try:
            async with asyncio.timeout(self.limits.idle_timeout):
                events = await self._header()
        except TimeoutError:
            raise IdleTimeout(f"no frame within the idle timeout ({self.limits.idle_timeout:g} s)") from None
        if events is None or events:  # EOF, or refused from the header alone (nothing reserved)
            yield events
            return
        declared = self.conn.next_frame_length
        assert declared is not None
        loop = asyncio.get_running_loop()
        started = loop.time()
        # The clock runs while the peer owes bytes, not while this server waits for budget.
        prefix = await self._within(self.limits.read_timeout, declared, min(declared, self.stream_buffer))
        if prefix is None:
            yield None
            return
        async with self.budget.hold(HEADER_BYTES + declared):
            rest = b""
            if declared > len(prefix):
                left = self.limits.read_timeout - (loop.time() - started)
                rest = await self._within(left, declared, declared - len(prefix))
                if rest is None:
                    yield None
                    return
            yield self.conn.receive_data(b"".join((prefix, rest)) if rest else prefix)

    async def _within(self, timeout: float, declared: int, n: int) -> bytes | None:
        """``n`` bytes of the current frame's body within ``timeout``; None at EOF."""
        try:
            async with asyncio.timeout(max(timeout, 0.0)):
                return await self.reader.readexactly(n)
        except asyncio.IncompleteReadError:
            return None
        except TimeoutError:
            raise ReadTimeout(
                f"frame of {declared} bytes not complete within the read timeout ({self.limits.read_timeout:g} s)"
            ) from None

    async def _header(self) -> list[Event] | None:
        try:
            header = await self.reader.readexactly(HEADER_BYTES)
        except asyncio.IncompleteReadError:
            return None
        return self.conn.receive_data(header)

    async def _body(self) -> list[Event] | None:
        declared = self.conn.next_frame_length
        assert declared is not None
        try:
            body = await self.reader.readexactly(declared)
        except asyncio.IncompleteReadError:
            return None
        return self.conn.receive_data(body)
