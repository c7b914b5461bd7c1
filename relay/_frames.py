"""Reading and writing whole protocol messages on asyncio streams."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from traceml_wire import FrameDecoder, ProtocolError, encode_frame, unpack_message

READ_CHUNK = 64 * 1024


class ConnectionClosed(ConnectionError):
    """The peer closed the stream (cleanly or not) between or inside frames."""


class MessageStream:
    """One connection: a frame decoder over a StreamReader plus its writer.

    Reads at most ``READ_CHUNK`` bytes at a time and only when the caller asks
    for the next message, so a slow consumer stops reading and TCP pushes back
    on the peer instead of this process buffering without bound.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_frame_bytes: int) -> None:
        self.reader = reader
        self.writer = writer
        self.decoder = FrameDecoder(max_frame_bytes)
        self._ready: deque[bytes] = deque()

    async def read_body(self) -> bytes:
        """The next raw frame body; raises ConnectionClosed at EOF."""
        while not self._ready:
            data = await self.reader.read(READ_CHUNK)
            if not data:
                if self.decoder.buffered_bytes:
                    raise ProtocolError("stream ended inside a frame")
                raise ConnectionClosed("peer closed the connection")
            self._ready.extend(self.decoder.feed(data))
        return self._ready.popleft()

    async def read_message(self) -> dict[str, Any]:
        return unpack_message(await self.read_body())

    def write(self, message: dict[str, Any] | bytes) -> None:
        self.writer.write(encode_frame(message))

    async def send(self, message: dict[str, Any] | bytes) -> None:
        self.write(message)
        await self.writer.drain()

    async def close(self) -> None:
        if self.writer.is_closing():
            return
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (OSError, ConnectionError):
            pass
