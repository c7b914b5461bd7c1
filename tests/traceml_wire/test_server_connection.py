"""ServerConnection, sans-I/O and in memory: what a hello must be, what an open
peer may send, what each state lets the server say, its frame caps and decode
limits. Raw frames stand in for a misbehaving client where ClientConnection would
refuse to produce them."""

from __future__ import annotations

import struct
from collections.abc import Callable

import pytest
from connection_pair import (
    AGENT,
    IDENTITY,
    RELAY,
    TOKEN,
    array_flood,
    garbage_frame,
    hello_bytes,
    open_pair,
    server_for,
    server_in,
)

from traceml_wire import MAX_HELLO_FRAME_BYTES, auth, messages
from traceml_wire.client_connection import ClientConnection
from traceml_wire.connection import LocalProtocolError, State
from traceml_wire.connection_events import BadHello, Batch, Hello, ProtocolFailure, RelayBatch
from traceml_wire.framing import HEADER_BYTES, encode_frame, pack_message, unpack_message
from traceml_wire.server_connection import ServerConnection

# ----------------------------------------------- the hello and the refusal


def test_an_old_client_without_cnonce_is_accepted_without_a_proof() -> None:
    server = server_for()
    server.send_challenge()
    mac = auth.hello_mac(TOKEN, server.nonce, "agent", AGENT)
    (hello,) = server.receive_data(encode_frame(messages.hello(role="agent", sender=AGENT, session="s1",
                                                               identity={}, mac=mac)))
    assert isinstance(hello, Hello)
    assert unpack_message(server.send_accept(0)[HEADER_BYTES:]) == {"t": "accept", "v": 1, "last_seq": 0}


def test_a_refusal_reason_holding_the_token_is_redacted() -> None:
    server = server_for()
    server.send_challenge()
    frame = server.send_refuse(f"config says {TOKEN}")
    assert TOKEN.encode() not in frame and b"config says" in frame


# --------------------------------------------- wrong message in each state


SERVER_BEFORE_HELLO: dict[str, Callable[[], bytes]] = {
    "batch": lambda: encode_frame(messages.batch(1, b"x")),
    "rbatch": lambda: encode_frame(messages.relay_batch(1, [], {}, {}, {})),
    "bye": lambda: encode_frame(messages.bye()),
    "ack": lambda: encode_frame(messages.ack(1)),
    "unknown": lambda: encode_frame({"t": "teleport"}),
    "not-msgpack": garbage_frame,
    "hello-without-mac": lambda: encode_frame({"t": "hello", "v": 1, "role": "agent", "sender": AGENT,
                                               "session": "s"}),
    "hello-wrong-version": lambda: encode_frame({"t": "hello", "v": 99, "role": "agent", "sender": AGENT,
                                                 "session": "s", "mac": b"m"}),
    "hello-short-cnonce": lambda: encode_frame({"t": "hello", "v": 1, "role": "agent", "sender": AGENT,
                                                "session": "s", "mac": b"m", "cnonce": b"c"}),
}


@pytest.mark.parametrize("name", list(SERVER_BEFORE_HELLO))
def test_server_refuses_anything_but_a_good_hello_first(name: str) -> None:
    server = server_for()
    server.send_challenge()
    events = server.receive_data(SERVER_BEFORE_HELLO[name]() + encode_frame(messages.bye()))
    assert len(events) == 1 and isinstance(events[0], BadHello), events  # nothing read past it
    assert server.state is State.MUST_REFUSE and not events[0].oversize
    assert server.receive_data(encode_frame(messages.bye())) == []
    with pytest.raises(LocalProtocolError):
        server.send_accept(0)
    server.send_refuse(events[0].reason)
    assert server.state is State.CLOSED


def test_server_refuses_a_role_it_does_not_serve() -> None:
    server, client = server_for(messages.ROLE_AGENT), ClientConnection(TOKEN)
    client.receive_data(server.send_challenge())
    (event,) = server.receive_data(hello_bytes(client, messages.ROLE_RELAY, RELAY))
    assert isinstance(event, BadHello) and "relay" in event.reason


SERVER_OPEN: dict[str, tuple[str, Callable[[ClientConnection], bytes]]] = {
    "second-hello": ("agent", lambda c: encode_frame(messages.hello(role="agent", sender=AGENT, session="s",
                                                                    identity={}, mac=b"m"))),
    "rbatch-from-agent": ("agent", lambda c: encode_frame(messages.relay_batch(1, [], {}, {}, {}))),
    "batch-from-relay": ("relay", lambda c: encode_frame(messages.batch(1, b"x"))),
    "unknown": ("agent", lambda c: encode_frame({"t": "teleport"})),
    "server-type": ("agent", lambda c: encode_frame(messages.ack(1))),
    "not-msgpack": ("agent", lambda c: garbage_frame()),
    "bad-seq-type": ("agent", lambda c: encode_frame({"t": "batch", "seq": "x", "body": b""})),
    "seq-zero": ("agent", lambda c: encode_frame(messages.batch(0, b"x"))),
    "seq-repeated": ("agent", lambda c: c.send_batch(1, b"x") + encode_frame(messages.batch(1, b"x"))),
    "seq-falling": ("agent", lambda c: c.send_batch(5, b"x") + encode_frame(messages.batch(4, b"x"))),
}


@pytest.mark.parametrize("name", list(SERVER_OPEN))
def test_server_fails_a_peer_that_breaks_the_open_conversation(name: str) -> None:
    role, make = SERVER_OPEN[name]
    server, client = open_pair(role)
    events = server.receive_data(make(client) + encode_frame(messages.bye()))
    assert isinstance(events[-1], ProtocolFailure) and not events[-1].oversize, events
    assert server.state is State.FAILED
    assert server.receive_data(encode_frame(messages.bye())) == []
    with pytest.raises(LocalProtocolError):
        server.send_ack(1)


# ------------------------------------------------------- local misuse


SERVER_SENDS: dict[str, Callable[[ServerConnection], bytes]] = {
    "challenge": lambda s: s.send_challenge(),
    "accept": lambda s: s.send_accept(0),
    "refuse": lambda s: s.send_refuse("no"),
    "ack": lambda s: s.send_ack(1),
}
SERVER_LEGAL = {
    State.SEND_CHALLENGE: {"challenge", "refuse"},
    State.AWAIT_HELLO: {"refuse"},
    State.DECIDE: {"accept", "refuse"},
    State.MUST_REFUSE: {"refuse"},
    State.OPEN: set(),  # ack is legal here once a batch arrived (below)
    State.CLOSED: set(),
    State.FAILED: set(),
}


@pytest.mark.parametrize("state", list(SERVER_LEGAL))
@pytest.mark.parametrize("send", list(SERVER_SENDS))
def test_server_sends_only_what_its_state_allows(state: State, send: str) -> None:
    server = server_in(state)
    if send in SERVER_LEGAL[state]:
        assert SERVER_SENDS[send](server)
    else:
        with pytest.raises(LocalProtocolError):
            SERVER_SENDS[send](server)


def test_server_acks_only_batches_it_received() -> None:
    server, client = open_pair()
    server.receive_data(client.send_batch(1, b"x") + client.send_batch(2, b"y"))
    assert server.send_ack(2) and server.send_ack(1)
    with pytest.raises(LocalProtocolError):
        server.send_ack(3)


def test_server_reads_nothing_before_its_challenge() -> None:
    with pytest.raises(LocalProtocolError):
        server_for().receive_data(b"\x00")


# ------------------------------------------------------- frame caps


def test_pre_hello_cap_refuses_from_the_header_alone() -> None:
    server = server_for()
    server.send_challenge()
    (event,) = server.receive_data(struct.pack(">I", MAX_HELLO_FRAME_BYTES + 1) + b"x" * 100)
    assert isinstance(event, BadHello) and event.oversize and event.declared == MAX_HELLO_FRAME_BYTES + 1
    assert "pre-hello cap" in event.reason and str(MAX_HELLO_FRAME_BYTES) in event.reason
    assert server.state is State.MUST_REFUSE


def test_full_cap_applies_after_the_accept_even_for_bytes_sent_behind_the_hello() -> None:
    server, client = server_for(max_frame_bytes=4 * MAX_HELLO_FRAME_BYTES), ClientConnection(TOKEN)
    client.receive_data(server.send_challenge())
    hello = hello_bytes(client)
    client.receive_data(encode_frame(messages.accept(0, proof=auth.accept_proof(
        TOKEN, client.cnonce, server.nonce, "agent", AGENT, 0))))
    big = b"b" * (2 * MAX_HELLO_FRAME_BYTES)
    # Pipelined: the hello and a batch over the hello cap in one read.
    events = server.receive_data(hello + client.send_batch(1, big))
    assert [type(e) for e in events] == [Hello]  # the batch waits for the decision
    server.send_accept(0)
    (batch,) = server.receive_data(b"")
    assert isinstance(batch, Batch) and batch.body == big


def test_over_the_full_cap_after_the_accept_fails_only_this_connection() -> None:
    server, _ = open_pair(max_frame_bytes=4096)
    (event,) = server.receive_data(struct.pack(">I", 4097))
    assert isinstance(event, ProtocolFailure) and event.oversize and event.declared == 4097
    assert "exceeds the cap" in event.reason and server.state is State.FAILED


# ------------------------------------------------------------- decode limits


def test_each_state_decodes_within_the_limits_of_its_frame_kind() -> None:
    # Before the accept: a hello-sized frame may not hold more than a hello's worth of entries.
    server, client = server_for(), ClientConnection(TOKEN)
    client.receive_data(server.send_challenge())
    flood = b"\x82" + pack_message("t") + pack_message("hello") + pack_message("pad") + array_flood(20_000)
    (event,) = server.receive_data(encode_frame(flood))
    assert isinstance(event, BadHello) and "decode limits" in event.reason
    # An accepted agent: a batch is a bin and a few fields; an array of thousands is refused ...
    server, client = open_pair(messages.ROLE_AGENT)
    wide = {"t": "batch", "seq": 1, "body": b"x", "pad": [0] * 1000}
    (event,) = server.receive_data(encode_frame(wide))
    assert isinstance(event, ProtocolFailure) and "max_array_len" in event.reason
    # ... while a relay's rbatch may carry thousands of items, each a decoded object or four.
    server, client = open_pair(messages.ROLE_RELAY)
    items = [[AGENT, seq, b"b"] for seq in range(1, 3001)]
    (event,) = server.receive_data(client.send_rbatch(1, items, {AGENT: IDENTITY}, {}, {}))
    assert isinstance(event, RelayBatch) and len(event.items) == 3000
    # ... but not millions of empty arrays, however they are nested.
    flood = b"\x83" + b"".join(pack_message(v) for v in ("t", "rbatch", "seq", 2, "items"))
    flood += b"\xdc\x04\x00" + (b"\xdc\x10\x00" + b"\x90" * 4096) * 1024
    (event,) = server.receive_data(encode_frame(flood))
    assert isinstance(event, ProtocolFailure) and "entries" in event.reason and server.state is State.FAILED
