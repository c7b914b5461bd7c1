"""ClientConnection, sans-I/O and in memory: the check of the server's proof,
what each state accepts from a server, what each state lets the client send, its
seqs, its frame cap and decode limits. Raw frames stand in for a misbehaving
server where ServerConnection would refuse to produce them."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import pytest
from connection_pair import AGENT, TOKEN, array_flood, awaiting_accept, client_in, garbage_frame, hello_bytes, open_pair

from traceml_wire import MAX_HELLO_FRAME_BYTES, auth, messages
from traceml_wire.client_connection import ClientConnection
from traceml_wire.connection import LocalProtocolError, State
from traceml_wire.connection_events import Accepted, Ack, ProtocolFailure, Refused, Unverified
from traceml_wire.framing import HEADER_BYTES, encode_frame, pack_message, unpack_message

# ------------------------------------------------------ authentication


def test_a_tokenless_client_ignores_a_proof() -> None:
    client, _, _ = awaiting_accept(token=None)
    assert client.receive_data(encode_frame(messages.accept(2, proof=b"p" * 32))) == [Accepted(2, verified=False)]


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
    "not-msgpack": (State.OPEN, garbage_frame()),
}


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


def test_client_caps_server_frames() -> None:
    client = ClientConnection(TOKEN)
    (event,) = client.receive_data(struct.pack(">I", MAX_HELLO_FRAME_BYTES + 1))
    assert isinstance(event, ProtocolFailure) and event.oversize


# ------------------------------------------------------------- decode limits


def test_a_client_decodes_server_messages_as_the_small_messages_they_are() -> None:
    client = ClientConnection(TOKEN)
    flood = b"\x83" + b"".join(pack_message(v) for v in ("t", "challenge", "nonce", b"n" * 16, "pad"))
    flood += array_flood(5000)
    (event,) = client.receive_data(encode_frame(flood))
    assert isinstance(event, ProtocolFailure) and "decode limits" in event.reason
