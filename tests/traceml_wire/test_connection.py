"""Both sides of the sans-I/O conversation together, in memory (no sockets): the
legal paths end to end, and the read loop they share (traceml_wire.connection)
taking bytes in any chunk size."""

from __future__ import annotations

import pytest
from connection_pair import AGENT, IDENTITY, RELAY, TOKEN, client_in, hello_bytes, open_pair, server_for, server_in
from hypothesis import given, settings
from hypothesis import strategies as st

from traceml_wire import auth, messages
from traceml_wire.client_connection import ClientConnection
from traceml_wire.connection import State
from traceml_wire.connection_events import (
    Accepted,
    Ack,
    BadHello,
    Batch,
    Bye,
    Challenge,
    Event,
    Hello,
    Refused,
    RelayBatch,
)
from traceml_wire.framing import HEADER_BYTES, encode_frame, pack_message, unpack_message

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


@pytest.mark.parametrize("state", [State.CLOSED, State.FAILED])
def test_nothing_is_read_once_a_connection_is_over(state: State) -> None:
    client = client_in(state)
    assert client.receive_data(encode_frame(messages.ack(1)) + encode_frame(messages.refuse("late"))) == []
    server = server_in(state)
    assert server.receive_data(encode_frame(messages.batch(5, b"late"))) == []


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
