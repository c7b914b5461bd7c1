"""Byte bounds on what the daemon holds between its sockets and the writer.

``ByteQueue``: between connection handlers and the single writer. Handlers
``await put`` and so stop reading their socket while the writer is behind: TCP
flow control then pushes back to the relays, which buffer (and count drops) on
their side. Bytes stay accounted until the writer ``release`` s them after its
commit, so the bound covers the transaction in flight too.

``ByteBudget``: frames read from sockets but not yet queued, across every
connection. Without it each handler blocked in ``put`` still held the frames
it had read, so a saturated daemon's memory grew with its connections. A
handler reserves a frame's bytes before it reads the body and
gives them back once the frame is queued (or dropped).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator
from typing import Generic, TypeVar

T = TypeVar("T")


class QueueClosed(Exception):
    pass


class ByteQueue(Generic[T]):
    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        self.max_bytes = max_bytes
        self._items: deque[tuple[T, int]] = deque()
        self._bytes = 0  # queued plus taken-but-not-released
        self._closed = False
        self._cond = asyncio.Condition()

    @property
    def bytes_held(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    async def put(self, item: T, nbytes: int) -> None:
        async with self._cond:
            # One item larger than the bound is let through alone, else it would wait forever.
            await self._cond.wait_for(lambda: self._closed or self._bytes == 0 or self._bytes + nbytes <= self.max_bytes)
            if self._closed:
                raise QueueClosed
            self._items.append((item, nbytes))
            self._bytes += nbytes
            self._cond.notify_all()

    async def get_many(self, max_bytes: int, timeout: float) -> list[tuple[T, int]]:
        """Wait up to ``timeout`` for items; take at least one and at most ~max_bytes.

        Returns [] on timeout, or when closed and empty.
        """
        async with self._cond:
            if not self._items and not self._closed:
                try:
                    await asyncio.wait_for(self._cond.wait_for(lambda: bool(self._items) or self._closed), timeout)
                except TimeoutError:
                    return []
            out: list[tuple[T, int]] = []
            taken = 0
            while self._items and (not out or taken + self._items[0][1] <= max_bytes):
                item = self._items.popleft()
                taken += item[1]
                out.append(item)
            return out

    async def release(self, nbytes: int) -> None:
        async with self._cond:
            self._bytes -= nbytes
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    async def close(self) -> None:
        """Refuse new items; the writer still drains what is queued."""
        async with self._cond:
            self._closed = True
            self._cond.notify_all()


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
