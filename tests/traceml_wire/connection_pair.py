"""A ServerConnection and a ClientConnection wired together in memory, and each
side brought to a given state: shared by the tests of both sides."""

from __future__ import annotations

import struct
from typing import Any

from traceml_wire import auth, messages
from traceml_wire.client_connection import ClientConnection
from traceml_wire.connection import State
from traceml_wire.connection_events import Accepted, Challenge, Event, Hello
from traceml_wire.framing import HEADER_BYTES, encode_frame, unpack_message
from traceml_wire.server_connection import ServerConnection

TOKEN = "conv-s3cret-token"
AGENT = "s1/a0/n0/r0/1-abc"
RELAY = "relay/s1/n0/1-r"
IDENTITY = {"global_rank": 0, "node_rank": 0}


def server_for(role: str = messages.ROLE_AGENT, token: str | None = TOKEN, **kw: Any) -> ServerConnection:
    return ServerConnection(token, roles=frozenset({role}), **kw)


def hello_bytes(client: ClientConnection, role: str = messages.ROLE_AGENT, sender: str = AGENT) -> bytes:
    return client.send_hello(role=role, sender=sender, session="s1", identity=IDENTITY)


def handshake(
    server: ServerConnection, client: ClientConnection, role: str = messages.ROLE_AGENT, last_seq: int = 0
) -> Event:
    """Run challenge, hello and accept between the two; return the client's last event."""
    assert client.receive_data(server.send_challenge()) == [Challenge(server.nonce)]
    (hello,) = server.receive_data(hello_bytes(client, role, AGENT if role == messages.ROLE_AGENT else RELAY))
    assert isinstance(hello, Hello), hello
    (reply,) = client.receive_data(server.send_accept(last_seq))
    return reply


def open_pair(role: str = messages.ROLE_AGENT, token: str | None = TOKEN, **kw: Any) -> tuple[ServerConnection, ClientConnection]:
    server, client = server_for(role, token, **kw), ClientConnection(token)
    assert isinstance(handshake(server, client, role), Accepted)
    return server, client


def awaiting_accept(token: str | None = TOKEN) -> tuple[ClientConnection, bytes, dict[str, Any]]:
    """A client that sent its hello to a raw peer: (client, server nonce, the hello it sent)."""
    client = ClientConnection(token)
    nonce = auth.new_nonce()
    client.receive_data(encode_frame(messages.challenge(nonce)))
    hello = unpack_message(hello_bytes(client)[HEADER_BYTES:])
    return client, nonce, hello


def client_in(state: State) -> ClientConnection:
    client = ClientConnection(None)
    if state is State.AWAIT_CHALLENGE:
        return client
    client.receive_data(encode_frame(messages.challenge(b"n" * 16)))
    if state is State.SEND_HELLO:
        return client
    hello_bytes(client)
    if state is State.AWAIT_ACCEPT:
        return client
    client.receive_data(encode_frame(messages.accept(0)))
    client.send_batch(1, b"x")
    if state is State.CLOSED:
        client.send_bye()
    elif state is State.FAILED:
        client.receive_data(encode_frame(messages.ack(9)))  # never sent
    assert client.state is state
    return client


def server_in(state: State) -> ServerConnection:
    server, client = server_for(), ClientConnection(TOKEN)
    if state is State.SEND_CHALLENGE:
        return server
    client.receive_data(server.send_challenge())
    if state is State.AWAIT_HELLO:
        return server
    if state is State.MUST_REFUSE:
        server.receive_data(encode_frame(messages.bye()))
        assert server.state is state
        return server
    server.receive_data(hello_bytes(client))
    if state is State.DECIDE:
        return server
    client.receive_data(server.send_accept(0))
    if state is State.OPEN:
        return server
    server.receive_data(client.send_bye() if state is State.CLOSED else encode_frame({"t": "teleport"}))
    assert server.state is state
    return server




def garbage_frame() -> bytes:
    """A frame whose body is no msgpack."""
    return struct.pack(">I", 3) + b"\xc1\xc1\xc1"


def array_flood(n: int) -> bytes:
    """An array of ``n`` empty arrays, packed: the cheapest bytes to expand."""
    return b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n
