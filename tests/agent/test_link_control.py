"""The agent's link takes control requests from its relay: hostile ones are refused and
counted and the connection goes on (acks still arrive), good ones are queued for the
sender loop up to MAX_CONTROLS (the rest counted), and the hello lists the capability."""

from __future__ import annotations

import socket
import threading
from typing import Any

from agent.link import MAX_CONTROLS, HelloInfo, Link
from traceml_wire import connection_events as conv
from traceml_wire import messages
from traceml_wire.connection import State
from traceml_wire.framing import encode_frame
from traceml_wire.server_connection import ServerConnection

TOKEN = "link-s3cret"
SENDER = "s1/a0/n0/r1/1-abc"


def _relay(listener: socket.socket, frames_after_accept: list[bytes], seen: dict[str, Any]) -> None:
    """The relay's side of the conversation on a real socket; after the accept and one
    batch, writes ``frames_after_accept`` and the batch's ack."""
    sock, _ = listener.accept()
    with sock:
        conn = ServerConnection(TOKEN, roles=frozenset({messages.ROLE_AGENT}))
        sock.sendall(conn.send_challenge())
        while conn.state is not State.DECIDE:
            for event in conn.receive_data(sock.recv(65536)):
                if isinstance(event, conv.Hello):
                    seen["hello"] = event
        sock.sendall(conn.send_accept(0))
        events = conn.receive_data(b"")  # what came behind the hello
        while not events:
            events = conn.receive_data(sock.recv(65536))
        sock.sendall(b"".join(frames_after_accept) + conn.send_ack(1))
        sock.recv(1)  # until the agent closes


def test_hostile_controls_are_counted_good_ones_queued_and_acks_still_arrive() -> None:
    good = [encode_frame(messages.control("profile", SENDER, 3, f"id{i:06d}")) for i in range(MAX_CONTROLS + 2)]
    hostile = [
        encode_frame({**messages.control("profile", SENDER, 3, "x"), "steps": 10**6}),
        encode_frame({**messages.control("profile", SENDER, 3, "x"), "op": "exec"}),
        encode_frame({**messages.control("profile", SENDER, 3, "x"), "id": ""}),
    ]
    listener = socket.create_server(("127.0.0.1", 0))
    seen: dict[str, Any] = {}
    relay = threading.Thread(target=_relay, args=(listener, hostile + good, seen), daemon=True)
    relay.start()
    hello = HelloInfo(sender=SENDER, session="s1", identity={"global_rank": 1})
    link, _ = Link.open("127.0.0.1", listener.getsockname()[1], token=TOKEN, hello=hello, timeout=5.0)
    try:
        assert messages.CAP_CONTROL in seen["hello"].caps
        link.send(link.conn.send_batch(1, b"body"))
        acked = 0
        for _ in range(100):
            acked = max(acked, link.read_acks(0.05))
            if acked:
                break
        assert acked == 1  # the stream survived every bad request
        assert [c.request_id for c in link.controls] == [f"id{i:06d}" for i in range(MAX_CONTROLS)]
        assert link.controls_refused == len(hostile) + 2  # three malformed, two past the bound
    finally:
        link.close(bye=False)
        relay.join(5)
        listener.close()
