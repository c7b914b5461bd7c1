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
gives them back once the frame is queued (or dropped). The relay bounds its
agent connections with the same class, so it lives in ``traceml_wire.aio``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

from traceml_wire.aio import ByteBudget

__all__ = ["ByteBudget", "ByteQueue", "QueueClosed"]

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
