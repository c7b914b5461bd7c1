"""Acknowledgements of one connection, written together.

The writer acknowledges a whole transaction's batches in one pass of the event
loop; queuing them here and writing them in one ``write`` at the end of that
pass costs one send syscall per connection and transaction instead of one per
batch. Every batch still gets its own ack, in order.
"""

from __future__ import annotations

import asyncio

from traceml_wire import messages
from traceml_wire.connection import State
from traceml_wire.framing import encode_frame
from traceml_wire.server_connection import ServerConnection


class AckWriter:
    """``conn``: the conversation the acks belong to, which checks each one; without
    it (a writer driven on its own) the acks are framed as they come."""

    def __init__(self, writer: asyncio.StreamWriter, conn: ServerConnection | None = None) -> None:
        self._writer = writer
        self._conn = conn
        self._frames: list[bytes] = []
        self.failed = False  # a batch of this connection was not stored (see fail)

    def ack(self, seq: int) -> None:
        conn = self._conn
        if conn is not None and conn.state is not State.OPEN:
            return  # the peer said bye or broke the protocol: its connection is closing
        if not self._frames:
            asyncio.get_running_loop().call_soon(self.flush)
        self._frames.append(conn.send_ack(seq) if conn is not None else encode_frame(messages.ack(seq)))

    def flush(self) -> None:
        frames, self._frames = self._frames, []
        if frames and not self._writer.is_closing():
            self._writer.write(b"".join(frames))

    def fail(self) -> None:
        """A batch was not stored: send the acks before it, then close, so the
        peer reconnects and resends from its buffer."""
        self.failed = True
        self.flush()
        self._writer.close()
