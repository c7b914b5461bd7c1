"""The wire protocol shared by agent, relay and daemon.

Sans-I/O: nothing here touches a socket, a thread or an event loop, and the
only third-party import is msgpack. Each peer wraps these pieces in its own
thin I/O shell (a thread in the agent, asyncio streams in relay and daemon)
around the conversation's state machines, ``ClientConnection`` and
``ServerConnection`` (traceml_wire.client_connection, .server_connection;
traceml_wire.connection draws the whole conversation). The one exception is
``traceml_wire.aio``, the asyncio read discipline the relay and the daemon
share; nothing here imports it.
"""

from traceml_wire.client_connection import ClientConnection
from traceml_wire.connection import LocalProtocolError, State
from traceml_wire.errors import FrameTooLarge, ProtocolError
from traceml_wire.framing import (
    BATCH_OVERHEAD_BYTES,
    DEFAULT_MAX_FRAME_BYTES,
    HEADER_BYTES,
    MAX_AGENT_BODY_BYTES,
    MAX_AGENT_FRAME_BYTES,
    MAX_HELLO_FRAME_BYTES,
    RBATCH_OVERHEAD_BYTES,
    FrameDecoder,
    encode_frame,
    pack_message,
    unpack_message,
)
from traceml_wire.server_connection import ServerConnection

__all__ = [
    "BATCH_OVERHEAD_BYTES",
    "ClientConnection",
    "LocalProtocolError",
    "ServerConnection",
    "State",
    "DEFAULT_MAX_FRAME_BYTES",
    "HEADER_BYTES",
    "MAX_AGENT_BODY_BYTES",
    "MAX_AGENT_FRAME_BYTES",
    "MAX_HELLO_FRAME_BYTES",
    "RBATCH_OVERHEAD_BYTES",
    "FrameDecoder",
    "FrameTooLarge",
    "ProtocolError",
    "encode_frame",
    "pack_message",
    "unpack_message",
]
