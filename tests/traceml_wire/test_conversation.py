"""The sans-I/O conversation: every legal and illegal transition, both sides, in
memory (no sockets). Raw frames stand in for a misbehaving peer where the other
state machine would refuse to produce them."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from traceml_wire import MAX_HELLO_FRAME_BYTES, auth, messages
from traceml_wire.conversation import (
    Accepted,
    Ack,
    BadHello,
    Batch,
    Bye,
    Challenge,
    ClientConnection,
    Event,
    Hello,
    LocalProtocolError,
    ProtocolFailure,
    Refused,
    RelayBatch,
    ServerConnection,
    State,
    Unverified,
)
from traceml_wire.framing import HEADER_BYTES, encode_frame, pack_message, unpack_message

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


# ------------------------------------------------------------- legal paths


def test_agent_conversation_with_a_token_step_by_step() -> None:
    server, client = server_for(), ClientConnection(TOKEN)
    assert (server.state, client.state) == (State.SEND_CHALLENGE, State.AWAIT_CHALLENGE)
    assert client.receive_data(server.send_challenge()) == [Challenge(server.nonce)]
    assert (server.state, client.state) == (State.AWAIT_HELLO, State.SEND_HELLO)
    hello_frame = hello_bytes(client)
    assert client.state is State.AWAIT_ACCEPT
    sent = unpack_message(hello_frame[HEADER_BYTES:])
    assert sent["cnonce"] == client.cnonce and len(sent["cnonce"]) == auth.NONCE_BYTES
    assert auth.verify_hello_mac(TOKEN, server.nonce, "agent", AGENT, sent["mac"])
    assert server.receive_data(hello_frame) == [Hello("agent", AGENT, "s1", IDENTITY)]
    assert server.state is State.DECIDE and server.hello is not None
    accept = server.send_accept(7)
    assert auth.verify_accept_proof(TOKEN, client.cnonce, server.nonce, "agent", AGENT, 7,
                                    unpack_message(accept[HEADER_BYTES:])["proof"])
    assert client.receive_data(accept) == [Accepted(7, verified=True)]
    assert (server.state, client.state) == (State.OPEN, State.OPEN) and client.last_seq == 7
    stream = client.send_batch(8, b"body8") + client.send_batch(9, b"body9")
    events = server.receive_data(stream)
    assert [(e.seq, e.body) for e in events if isinstance(e, Batch)] == [(8, b"body8"), (9, b"body9")]
    assert client.receive_data(server.send_ack(8) + server.send_ack(9)) == [Ack(8), Ack(9)]
    assert server.receive_data(client.send_bye()) == [Bye()]
    assert (server.state, client.state) == (State.CLOSED, State.CLOSED)


def test_relay_conversation_carries_cleaned_rbatches() -> None:
    server, client = open_pair(messages.ROLE_RELAY)
    frame = client.send_rbatch(1, [[AGENT, 3, b"x"]], {AGENT: {"global_rank": 0, "junk": 1}},
                               {"node_rank": 2, "hostname": "h"}, {"dropped_batches": 1, "bad": "x"}, sender=RELAY,
                               spool_dropped_upto=4)
    (event,) = server.receive_data(frame)
    assert isinstance(event, RelayBatch)
    assert (event.seq, event.items, event.peers, event.node) == (1, [[AGENT, 3, b"x"]], {AGENT: {"global_rank": 0}},
                                                                 {"node_rank": 2, "hostname": "h"})
    assert event.stats == {"dropped_batches": 1} and event.sender == RELAY and event.spool_dropped_upto == 4
    assert event.nbytes == len(frame) - HEADER_BYTES
    assert client.receive_data(server.send_ack(1)) == [Ack(1)]


def test_without_a_token_there_is_no_proof_and_nothing_is_required() -> None:
    server, client = server_for(token=None), ClientConnection(None)
    client.receive_data(server.send_challenge())
    server.receive_data(hello_bytes(client))
    accept = server.send_accept(0)
    assert "proof" not in unpack_message(accept[HEADER_BYTES:])
    assert client.receive_data(accept) == [Accepted(0, verified=False)]


def test_an_old_client_without_cnonce_is_accepted_without_a_proof() -> None:
    server = server_for()
    server.send_challenge()
    mac = auth.hello_mac(TOKEN, server.nonce, "agent", AGENT)
    (hello,) = server.receive_data(encode_frame(messages.hello(role="agent", sender=AGENT, session="s1",
                                                               identity={}, mac=mac)))
    assert isinstance(hello, Hello)
    assert unpack_message(server.send_accept(0)[HEADER_BYTES:]) == {"t": "accept", "v": 1, "last_seq": 0}


def test_a_tokenless_client_ignores_a_proof() -> None:
    client, _, _ = awaiting_accept(token=None)
    assert client.receive_data(encode_frame(messages.accept(2, proof=b"p" * 32))) == [Accepted(2, verified=False)]


def test_unknown_fields_are_ignored_on_both_sides() -> None:
    server = server_for()
    client = ClientConnection(TOKEN)
    client.receive_data(encode_frame({**messages.challenge(server.nonce), "future": [1]}))
    server.send_challenge()
    hello = unpack_message(hello_bytes(client)[HEADER_BYTES:])
    (event,) = server.receive_data(encode_frame({**hello, "extra": {"a": 1}}))
    assert isinstance(event, Hello)
    accept = unpack_message(server.send_accept(0)[HEADER_BYTES:])
    assert client.receive_data(encode_frame({**accept, "window": 3})) == [Accepted(0, verified=True)]
    client.send_batch(1, b"x")  # the same batch goes out below with a field added
    (batch,) = server.receive_data(encode_frame({**messages.batch(1, b"x"), "new": 1}))
    assert isinstance(batch, Batch)
    assert client.receive_data(encode_frame({**messages.ack(1), "n": 2})) == [Ack(1)]


# ------------------------------------------------------ authentication


def test_a_wrong_token_is_refused_and_the_reason_never_holds_the_token() -> None:
    server, client = server_for(), ClientConnection("not-the-token")
    client.receive_data(server.send_challenge())
    (event,) = server.receive_data(hello_bytes(client))
    assert isinstance(event, BadHello) and "token" in event.reason and TOKEN not in event.reason
    assert server.state is State.MUST_REFUSE
    refusal = server.send_refuse(event.reason)
    assert server.state is State.CLOSED and TOKEN.encode() not in refusal
    assert client.receive_data(refusal) == [Refused(event.reason)]
    assert client.state is State.CLOSED


def test_a_refusal_reason_holding_the_token_is_redacted() -> None:
    server = server_for()
    server.send_challenge()
    frame = server.send_refuse(f"config says {TOKEN}")
    assert TOKEN.encode() not in frame and b"config says" in frame


def test_accept_without_a_proof_is_unverified() -> None:
    client, _, _ = awaiting_accept()
    (event,) = client.receive_data(encode_frame(messages.accept(0)))
    assert isinstance(event, Unverified) and "proof" in event.reason
    assert client.state is State.FAILED
    with pytest.raises(LocalProtocolError):
        client.send_batch(1, b"x")  # nothing may go to a server that could not prove the token
    assert client.receive_data(encode_frame(messages.ack(1))) == []


def _proof_for(client: ClientConnection, nonce: bytes, **over: Any) -> bytes:
    args: dict[str, Any] = {"token": TOKEN, "cnonce": client.cnonce, "snonce": nonce, "role": "agent",
                            "sender": AGENT, "last_seq": 0, **over}
    return auth.accept_proof(**args)


@pytest.mark.parametrize("wrong", [
    {"token": "other-token"},
    {"cnonce": b"c" * 16},  # a proof replayed from another conversation
    {"snonce": b"s" * 16},
    {"role": "relay"},
    {"sender": "someone-else"},
    {"last_seq": 5},  # the accept's last_seq is bound: it cannot be altered on the way
], ids=["token", "cnonce", "snonce", "role", "sender", "last_seq"])
def test_a_proof_bound_to_anything_else_is_unverified(wrong: dict[str, Any]) -> None:
    client, nonce, _ = awaiting_accept()
    (event,) = client.receive_data(encode_frame(messages.accept(0, proof=_proof_for(client, nonce, **wrong))))
    assert isinstance(event, Unverified) and client.state is State.FAILED


def test_the_right_proof_verifies() -> None:
    client, nonce, _ = awaiting_accept()
    assert client.receive_data(encode_frame(messages.accept(0, proof=_proof_for(client, nonce)))) == [
        Accepted(0, verified=True)]


def test_a_server_echoing_the_hello_mac_as_its_proof_is_unverified() -> None:
    """Domain separation: the client's own MAC (which a squatter has in hand) is no proof,
    even when the squatter chose its nonce to be the client's nonce."""
    client = ClientConnection(TOKEN, cnonce=b"n" * 16)
    client.receive_data(encode_frame(messages.challenge(b"n" * 16)))
    hello = unpack_message(hello_bytes(client)[HEADER_BYTES:])
    (event,) = client.receive_data(encode_frame(messages.accept(0, proof=hello["mac"])))
    assert isinstance(event, Unverified)


def test_a_malformed_proof_counts_as_none() -> None:
    client, _, _ = awaiting_accept()
    (event,) = client.receive_data(encode_frame({**messages.accept(0), "proof": "text"}))
    assert isinstance(event, Unverified)


# --------------------------------------------- wrong message in each state


def _garbage() -> bytes:
    return struct.pack(">I", 3) + b"\xc1\xc1\xc1"


SERVER_BEFORE_HELLO: dict[str, Callable[[], bytes]] = {
    "batch": lambda: encode_frame(messages.batch(1, b"x")),
    "rbatch": lambda: encode_frame(messages.relay_batch(1, [], {}, {}, {})),
    "bye": lambda: encode_frame(messages.bye()),
    "ack": lambda: encode_frame(messages.ack(1)),
    "unknown": lambda: encode_frame({"t": "teleport"}),
    "not-msgpack": _garbage,
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


def _open_server(role: str = messages.ROLE_AGENT) -> tuple[ServerConnection, ClientConnection]:
    return open_pair(role)


SERVER_OPEN: dict[str, tuple[str, Callable[[ClientConnection], bytes]]] = {
    "second-hello": ("agent", lambda c: encode_frame(messages.hello(role="agent", sender=AGENT, session="s",
                                                                    identity={}, mac=b"m"))),
    "rbatch-from-agent": ("agent", lambda c: encode_frame(messages.relay_batch(1, [], {}, {}, {}))),
    "batch-from-relay": ("relay", lambda c: encode_frame(messages.batch(1, b"x"))),
    "unknown": ("agent", lambda c: encode_frame({"t": "teleport"})),
    "server-type": ("agent", lambda c: encode_frame(messages.ack(1))),
    "not-msgpack": ("agent", lambda c: _garbage()),
    "bad-seq-type": ("agent", lambda c: encode_frame({"t": "batch", "seq": "x", "body": b""})),
    "seq-zero": ("agent", lambda c: encode_frame(messages.batch(0, b"x"))),
    "seq-repeated": ("agent", lambda c: c.send_batch(1, b"x") + encode_frame(messages.batch(1, b"x"))),
    "seq-falling": ("agent", lambda c: c.send_batch(5, b"x") + encode_frame(messages.batch(4, b"x"))),
}


@pytest.mark.parametrize("name", list(SERVER_OPEN))
def test_server_fails_a_peer_that_breaks_the_open_conversation(name: str) -> None:
    role, make = SERVER_OPEN[name]
    server, client = _open_server(role)
    events = server.receive_data(make(client) + encode_frame(messages.bye()))
    assert isinstance(events[-1], ProtocolFailure) and not events[-1].oversize, events
    assert server.state is State.FAILED
    assert server.receive_data(encode_frame(messages.bye())) == []
    with pytest.raises(LocalProtocolError):
        server.send_ack(1)


def _raw(message: dict[str, Any]) -> bytes:
    return encode_frame(message)


CLIENT_WRONG: dict[str, tuple[State, bytes]] = {
    "accept-before-challenge": (State.AWAIT_CHALLENGE, _raw(messages.accept(0))),
    "ack-before-challenge": (State.AWAIT_CHALLENGE, _raw(messages.ack(1))),
    "unknown-before-challenge": (State.AWAIT_CHALLENGE, _raw({"t": "teleport"})),
    "short-nonce": (State.AWAIT_CHALLENGE, _raw({"t": "challenge", "v": 1, "nonce": b"short"})),
    "accept-before-hello": (State.SEND_HELLO, _raw(messages.accept(0))),
    "challenge-twice": (State.SEND_HELLO, _raw(messages.challenge(b"n" * 16))),
    "challenge-after-hello": (State.AWAIT_ACCEPT, _raw(messages.challenge(b"n" * 16))),
    "ack-before-accept": (State.AWAIT_ACCEPT, _raw(messages.ack(1))),
    "client-type": (State.AWAIT_ACCEPT, _raw(messages.bye())),
    "challenge-when-open": (State.OPEN, _raw(messages.challenge(b"n" * 16))),
    "accept-when-open": (State.OPEN, _raw(messages.accept(0))),
    "ack-never-sent": (State.OPEN, _raw(messages.ack(3))),
    "not-msgpack": (State.OPEN, _garbage()),
}


def client_in(state: State) -> ClientConnection:
    client = ClientConnection(None)
    if state is State.AWAIT_CHALLENGE:
        return client
    client.receive_data(_raw(messages.challenge(b"n" * 16)))
    if state is State.SEND_HELLO:
        return client
    hello_bytes(client)
    if state is State.AWAIT_ACCEPT:
        return client
    client.receive_data(_raw(messages.accept(0)))
    client.send_batch(1, b"x")
    if state is State.CLOSED:
        client.send_bye()
    elif state is State.FAILED:
        client.receive_data(_raw(messages.ack(9)))  # never sent
    assert client.state is state
    return client


@pytest.mark.parametrize("name", list(CLIENT_WRONG))
def test_client_fails_a_server_that_breaks_the_conversation(name: str) -> None:
    state, frame = CLIENT_WRONG[name]
    client = client_in(state)
    events = client.receive_data(frame + _raw(messages.refuse("later")))
    assert len(events) == 1 and isinstance(events[0], ProtocolFailure), events
    assert client.state is State.FAILED


@pytest.mark.parametrize("state", [State.AWAIT_CHALLENGE, State.SEND_HELLO, State.AWAIT_ACCEPT, State.OPEN])
def test_a_refusal_is_legal_in_every_client_state(state: State) -> None:
    client = client_in(state)
    assert client.receive_data(_raw(messages.refuse("too many connections"))) == [Refused("too many connections")]
    assert client.state is State.CLOSED


def test_acks_are_bounded_by_what_was_sent_or_held() -> None:
    client = client_in(State.AWAIT_ACCEPT)
    client.receive_data(_raw(messages.accept(10)))
    assert client.receive_data(_raw(messages.ack(10))) == [Ack(10)]  # held before this connection
    assert isinstance(client.receive_data(_raw(messages.ack(11)))[0], ProtocolFailure)


# ------------------------------------------------------- local misuse


def _server_in(state: State) -> ServerConnection:
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
    server = _server_in(state)
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


CLIENT_SENDS: dict[str, Callable[[ClientConnection], bytes]] = {
    "hello": lambda c: hello_bytes(c),
    "batch": lambda c: c.send_batch(5, b"x"),
    "rbatch": lambda c: c.send_rbatch(5, [], {}, {}, {}),
    "encoded": lambda c: c.send_encoded(5, encode_frame(messages.batch(5, b"x"))),
    "bye": lambda c: c.send_bye(),
}
CLIENT_LEGAL = {
    State.AWAIT_CHALLENGE: set(),
    State.SEND_HELLO: {"hello"},
    State.AWAIT_ACCEPT: set(),
    State.OPEN: {"batch", "encoded", "bye"},  # an agent's connection: no rbatch
    State.CLOSED: set(),
    State.FAILED: set(),
}


@pytest.mark.parametrize("state", list(CLIENT_LEGAL))
@pytest.mark.parametrize("send", list(CLIENT_SENDS))
def test_client_sends_only_what_its_state_allows(state: State, send: str) -> None:
    client = client_in(state)
    if send in CLIENT_LEGAL[state]:
        assert CLIENT_SENDS[send](client)
    else:
        with pytest.raises(LocalProtocolError):
            CLIENT_SENDS[send](client)


@pytest.mark.parametrize("state", [State.CLOSED, State.FAILED])
def test_nothing_is_read_once_a_connection_is_over(state: State) -> None:
    client = client_in(state)
    assert client.receive_data(_raw(messages.ack(1)) + _raw(messages.refuse("late"))) == []
    server = _server_in(state)
    assert server.receive_data(encode_frame(messages.batch(5, b"late"))) == []


def test_client_seqs_rise_and_nothing_follows_bye() -> None:
    client = client_in(State.OPEN)  # sent seq 1
    with pytest.raises(LocalProtocolError):
        client.send_batch(1, b"again")
    client.send_encoded(2, b"frame")
    client.send_bye()
    assert client.state is State.CLOSED
    for send in CLIENT_SENDS.values():
        with pytest.raises(LocalProtocolError):
            send(client)


def test_a_relay_client_sends_rbatches_only() -> None:
    _, client = open_pair(messages.ROLE_RELAY)
    with pytest.raises(LocalProtocolError):
        client.send_batch(1, b"x")
    assert client.send_rbatch(1, [], {}, {}, {})


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


def test_client_caps_server_frames() -> None:
    client = ClientConnection(TOKEN)
    (event,) = client.receive_data(struct.pack(">I", MAX_HELLO_FRAME_BYTES + 1))
    assert isinstance(event, ProtocolFailure) and event.oversize


def test_next_frame_length_is_known_before_the_body_is_read() -> None:
    server, client = open_pair()
    frame = client.send_batch(1, b"z" * 1000)
    assert server.receive_data(frame[:HEADER_BYTES]) == [] and server.next_frame_length == len(frame) - HEADER_BYTES
    assert server.in_frame and server.expected_bytes() == len(frame) - HEADER_BYTES
    body = frame[HEADER_BYTES:]
    (event,) = server.receive_data(body)
    assert isinstance(event, Batch) and server.next_frame_length is None and not server.in_frame
    assert event.body == b"z" * 1000


# ----------------------------------------------------- odd chunk sizes


def _whole_agent_stream(client: ClientConnection) -> bytes:
    """Batches 3..7 (the server held 2 already)."""
    return b"".join(client.send_batch(seq, bytes([seq]) * seq * 37) for seq in range(3, 8))


def _split(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 64, 4096])
def test_both_sides_take_bytes_in_any_chunk_size(size: int) -> None:
    server, client = server_for(), ClientConnection(TOKEN)
    client_events = [e for chunk in _split(server.send_challenge(), size) for e in client.receive_data(chunk)]
    server_events = [e for chunk in _split(hello_bytes(client), size) for e in server.receive_data(chunk)]
    client_events += [e for chunk in _split(server.send_accept(2), size) for e in client.receive_data(chunk)]
    server_events += [e for chunk in _split(_whole_agent_stream(client), size) for e in server.receive_data(chunk)]
    acks = b"".join(server.send_ack(seq) for seq in range(3, 6))
    client_events += [e for chunk in _split(acks, size) for e in client.receive_data(chunk)]
    server_events += [e for chunk in _split(client.send_bye(), size) for e in server.receive_data(chunk)]
    assert client_events == [Challenge(server.nonce), Accepted(2, True), Ack(3), Ack(4), Ack(5)]
    assert [type(e).__name__ for e in server_events] == ["Hello", *["Batch"] * 5, "Bye"]
    assert [e.seq for e in server_events if isinstance(e, Batch)] == [3, 4, 5, 6, 7]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=20))
def test_any_split_of_a_relay_stream_gives_the_same_events(cuts: list[int]) -> None:
    server, client = server_for(messages.ROLE_RELAY), ClientConnection(TOKEN)
    client.receive_data(server.send_challenge())
    stream = hello_bytes(client, messages.ROLE_RELAY, RELAY)
    events: list[Event] = []
    pos = 0
    chunks = []
    for cut in cuts:
        chunks.append(stream[pos : pos + cut])
        pos += cut
    chunks.append(stream[pos:])
    for chunk in chunks:
        events += server.receive_data(chunk)
    assert events == [Hello("relay", RELAY, "s1", IDENTITY)]


def test_nothing_is_read_after_bye_in_the_same_chunk() -> None:
    server, client = open_pair()
    events = server.receive_data(client.send_bye() + encode_frame(messages.batch(1, b"late")))
    assert events == [Bye()]
    assert server.receive_data(encode_frame(messages.batch(2, b"later"))) == []


def test_every_message_kind_round_trips_through_pack() -> None:
    # The conversation frames exactly what messages builds (the wire stays compatible).
    _, client = open_pair()
    assert client.send_batch(1, b"x") == encode_frame(pack_message(messages.batch(1, b"x")))


# ------------------------------------------------------------- decode limits


def _flood(n: int) -> bytes:
    """An array of ``n`` empty arrays, packed: the cheapest bytes to expand."""
    return b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n


def test_each_state_decodes_within_the_limits_of_its_frame_kind() -> None:
    # Before the accept: a hello-sized frame may not hold more than a hello's worth of entries.
    server, client = server_for(), ClientConnection(TOKEN)
    client.receive_data(server.send_challenge())
    flood = b"\x82" + pack_message("t") + pack_message("hello") + pack_message("pad") + _flood(20_000)
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


def test_a_client_decodes_server_messages_as_the_small_messages_they_are() -> None:
    client = ClientConnection(TOKEN)
    flood = b"\x83" + b"".join(pack_message(v) for v in ("t", "challenge", "nonce", b"n" * 16, "pad")) + _flood(5000)
    (event,) = client.receive_data(encode_frame(flood))
    assert isinstance(event, ProtocolFailure) and "decode limits" in event.reason
