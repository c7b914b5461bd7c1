"""Control requests (server -> client): the capability a hello lists, strict validation
of each field (a hostile request is refused and counted by the shell, the connection
stays open), and older clients that never listed the capability never get one."""

from __future__ import annotations

from typing import Any

import pytest

from traceml_wire import messages
from traceml_wire.client_connection import ClientConnection
from traceml_wire.connection import LocalProtocolError, State
from traceml_wire.connection_events import (
    Accepted,
    Ack,
    Answer,
    Challenge,
    Control,
    ControlRefused,
    Hello,
    ProtocolFailure,
    Request,
)
from traceml_wire.framing import encode_frame
from traceml_wire.server_connection import ServerConnection

TOKEN = "ctl-s3cret-token"
AGENT = "s1/a0/n0/r1/1-abc"


def open_pair(caps: tuple[str, ...] = (messages.CAP_CONTROL,)) -> tuple[ServerConnection, ClientConnection]:
    server, client = ServerConnection(TOKEN), ClientConnection(TOKEN)
    assert client.receive_data(server.send_challenge()) == [Challenge(server.nonce)]
    frame = client.send_hello(role=messages.ROLE_AGENT, sender=AGENT, session="s1", identity={"global_rank": 1},
                              caps=caps)
    (hello,) = server.receive_data(frame)
    assert isinstance(hello, Hello) and hello.caps == frozenset(caps)
    assert isinstance(client.receive_data(server.send_accept())[0], Accepted)
    return server, client


def test_a_control_reaches_a_client_that_listed_the_capability() -> None:
    server, client = open_pair()
    events = client.receive_data(server.send_control(messages.OP_PROFILE, AGENT, 3, "req-1"))
    assert events == [Control("profile", AGENT, 3, "req-1")]
    assert client.state is State.OPEN


def test_the_server_refuses_to_send_control_to_an_older_client() -> None:
    server, _ = open_pair(caps=())
    with pytest.raises(LocalProtocolError, match="capability"):
        server.send_control(messages.OP_PROFILE, AGENT, 3, "req-1")


def test_a_control_to_a_client_that_never_listed_it_ends_that_connection() -> None:
    """What an older client does with an unknown type; a newer one without the
    capability does the same, so a server that ignores caps is caught."""
    _, client = open_pair(caps=())
    (event,) = client.receive_data(encode_frame(messages.control("profile", AGENT, 3, "r")))
    assert isinstance(event, ProtocolFailure) and client.state is State.FAILED


def test_a_server_never_builds_an_out_of_bounds_request() -> None:
    server, _ = open_pair()
    for steps in (0, messages.MAX_PROFILE_STEPS + 1):
        with pytest.raises(LocalProtocolError, match="steps"):
            server.send_control(messages.OP_PROFILE, AGENT, steps, "r")
    with pytest.raises(LocalProtocolError, match="op"):
        server.send_control("rm -rf", AGENT, 1, "r")


HOSTILE: list[dict[str, Any]] = [
    {"op": "shutdown"},
    {"op": 7},
    {"steps": 0},
    {"steps": -1},
    {"steps": messages.MAX_PROFILE_STEPS + 1},
    {"steps": 2**63 - 1},
    {"steps": True},
    {"steps": 3.0},
    {"steps": "3"},
    {"sender": ""},
    {"sender": "x" * 201},
    {"sender": None},
    {"id": ""},
    {"id": "x" * (messages.MAX_CONTROL_ID_CHARS + 1)},
    {"id": "bell\x07"},
    {"id": "é"},
    {"id": b"bytes"},
]


@pytest.mark.parametrize("change", HOSTILE, ids=[repr(c)[:40] for c in HOSTILE])
def test_hostile_control_values_are_refused_and_the_connection_survives(change: dict[str, Any]) -> None:
    server, client = open_pair()
    message = {**messages.control("profile", AGENT, 3, "req-1"), **change}
    (event,) = client.receive_data(encode_frame(message))
    assert isinstance(event, ControlRefused)
    assert client.state is State.OPEN
    # The stream goes on: a batch and its ack, then a good request.
    server.receive_data(client.send_batch(1, b"body"))
    assert client.receive_data(server.send_ack(1)) == [Ack(1)]
    assert client.receive_data(server.send_control("profile", AGENT, 2, "req-2")) == [
        Control("profile", AGENT, 2, "req-2")
    ]


def test_a_control_before_the_accept_is_a_protocol_error() -> None:
    server, client = ServerConnection(TOKEN), ClientConnection(TOKEN)
    client.receive_data(server.send_challenge())
    client.send_hello(role=messages.ROLE_AGENT, sender=AGENT, session="s1", identity={}, caps=("control",))
    (event,) = client.receive_data(encode_frame(messages.control("profile", AGENT, 3, "r")))
    assert isinstance(event, ProtocolFailure)


def test_hello_caps_are_cleaned_not_fatal() -> None:
    """Caps is optional: junk in it reads as no capability, never a refused hello."""
    for raw, expected in (
        ("control", frozenset()),
        ([1, None, "control", "future-thing"], frozenset({"control"})),
        (["x"] * 1000 + ["control"], frozenset()),
        ({"control": 1}, frozenset()),
    ):
        assert messages.clean_caps(raw) == expected
    client = ClientConnection(TOKEN)
    with pytest.raises(LocalProtocolError, match="unknown capabilities"):
        client.receive_data(ServerConnection(TOKEN).send_challenge())
        client.send_hello(role="agent", sender=AGENT, session="s", identity={}, caps=("telepathy",))


def _control_pair() -> tuple[ServerConnection, ClientConnection]:
    server, client = ServerConnection(TOKEN), ClientConnection(TOKEN)
    client.receive_data(server.send_challenge())
    (hello,) = server.receive_data(client.send_hello(role=messages.ROLE_CONTROL, sender="control/1", session="",
                                                     identity={}))
    assert isinstance(hello, Hello)
    assert isinstance(client.receive_data(server.send_accept())[0], Accepted)
    return server, client


def test_a_control_client_asks_and_is_answered() -> None:
    server, client = _control_pair()
    (request,) = server.receive_data(client.send_request("profile", 1, 3, "abcd1234", "s1"))
    assert request == Request("profile", 1, 3, "abcd1234", "s1")
    (answer,) = client.receive_data(server.send_answer("abcd1234", "sent", "ok", AGENT, "s1"))
    assert answer == Answer("abcd1234", "sent", "ok", AGENT, "s1")


@pytest.mark.parametrize("change", [
    {"op": "shutdown"}, {"op": ["profile"]}, {"rank": -1}, {"rank": 2**40}, {"rank": None}, {"steps": 0},
    {"steps": messages.MAX_PROFILE_STEPS + 1}, {"session": ""}, {"session": 5}, {"id": "\x1b[2J"},
])
def test_hostile_requests_end_that_connection_only(change: dict[str, Any]) -> None:
    server, client = _control_pair()
    (event,) = server.receive_data(encode_frame({**messages.request("profile", 1, 3, "abcd1234"), **change}))
    assert isinstance(event, ProtocolFailure) and server.state is State.FAILED


def test_only_control_clients_request_and_only_they_are_answered() -> None:
    server, client = open_pair()
    (event,) = server.receive_data(encode_frame(messages.request("profile", 1, 3, "abcd1234")))
    assert isinstance(event, ProtocolFailure)
    server, client = open_pair()
    with pytest.raises(LocalProtocolError):
        server.send_answer("abcd1234", "sent", "ok")
    with pytest.raises(LocalProtocolError):
        client.send_request("profile", 1, 3, "abcd1234")


@pytest.mark.parametrize("change", [{"status": "maybe"}, {"status": {}}, {"id": ""}, {"id": 7}])
def test_hostile_answers_end_the_control_connection(change: dict[str, Any]) -> None:
    _, client = _control_pair()
    (event,) = client.receive_data(encode_frame({**messages.answer("abcd1234", "sent", "ok"), **change}))
    assert isinstance(event, ProtocolFailure)


def test_answer_text_fields_are_cut_not_fatal() -> None:
    _, client = _control_pair()
    (event,) = client.receive_data(encode_frame({**messages.answer("abcd1234", "refused", "x" * 5000),
                                                 "sender": 5, "session": "s" * 400}))
    assert isinstance(event, Answer)
    assert len(event.message) == messages.MAX_ANSWER_CHARS and event.sender is None and len(event.session or "") == 256
