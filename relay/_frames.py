"""One asyncio connection under a conversation state machine (traceml_wire.connection).

The state machine decides what every byte means; this only moves bytes: it
reads when the relay asks for the next events and writes what the state
machine produced.
"""

from __future__ import annotations

import asyncio

from traceml_wire import ProtocolError
from traceml_wire.client_connection import ClientConnection
from traceml_wire.connection_events import Event
from traceml_wire.server_connection import ServerConnection

READ_CHUNK = 64 * 1024


class ConnectionClosed(ConnectionError):
    """The peer closed the stream (cleanly or not) between or inside frames."""


class Wire:
    """A StreamReader/StreamWriter pair and the conversation running over them.

    Reads at most ``READ_CHUNK`` bytes at a time and only when the caller asks
    for the next events, so a slow consumer stops reading and TCP pushes back
    on the peer instead of this process buffering without bound.
    """

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: ClientConnection | ServerConnection
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.conn = conn

    async def events(self) -> list[Event]:
        """The next events; raises ConnectionClosed at EOF (ProtocolError inside a frame)."""
        # First what the conversation held back while a hello waited for its accept.
        events = self.conn.receive_data(b"")
        while not events:
            data = await self.reader.read(READ_CHUNK)
            if not data:
                if self.conn.in_frame:
                    raise ProtocolError("stream ended inside a frame")
                raise ConnectionClosed("peer closed the connection")
            events = self.conn.receive_data(data)
        return events

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def close(self) -> None:
        if self.writer.is_closing():
            return
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (OSError, ConnectionError):
            pass
