"""The real daemon process on a real port and a real SQLite file, driven by a
small client speaking the real wire."""

from __future__ import annotations

import sqlite3
import struct
from pathlib import Path
from typing import Any

from tests.support.procs import DaemonProcess, base_env, wait_for
from tests.traceml_daemon.wire_client import (
    RELAY,
    WireClient,
    agent_sender,
    count_steps,
    daemon_counters,
    peers_for,
    steps_body,
)
from traceml_daemon.net.peer import as_batch, new_connection, tls_hint
from traceml_wire import auth, messages
from traceml_wire import connection_events as conv
from traceml_wire.connection import State
from traceml_wire.framing import HEADER_BYTES, encode_frame
from traceml_wire.server_connection import ServerConnection


def test_ack_only_after_rows_are_committed_and_resend_is_deduplicated(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    a0, a1 = agent_sender("s1", 0), agent_sender("s1", 1)
    with DaemonProcess(db) as daemon:
        with WireClient(daemon.port) as c:
            assert c.handshake(RELAY)["t"] == messages.ACCEPT
            c.rbatch(1, [[a0, 1, steps_body(0, 10)], [a1, 1, steps_body(0, 10)]], peers_for(0, 1))
            assert c.recv() == {"t": "ack", "seq": 1}
            # The ack promises durability: the rows are visible to a fresh reader now.
            assert count_steps(db) == 20
            c.rbatch(2, [[a0, 2, steps_body(10, 5)]], peers_for(0))
            assert c.recv() == {"t": "ack", "seq": 2}
            assert count_steps(db) == 25
        # A relay that lost its acks resends everything after a reconnect.
        with WireClient(daemon.port) as c:
            assert c.handshake(RELAY)["t"] == messages.ACCEPT
            c.rbatch(1, [[a0, 1, steps_body(0, 10)], [a1, 1, steps_body(0, 10)]], peers_for(0, 1))
            c.rbatch(2, [[a0, 2, steps_body(10, 5)], [a0, 3, steps_body(15, 5)]], peers_for(0))
            assert c.recv() is not None and c.recv() == {"t": "ack", "seq": 2}
            assert count_steps(db) == 30
        assert daemon.stop() == 0
    counters = daemon_counters(db)
    assert counters["rows_stored"] == 30
    assert counters["duplicates_discarded"] == 3


def test_bad_token_is_refused_logged_and_stores_nothing(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    token = "s3cret-token-value"
    with DaemonProcess(db, env=base_env(TRACEML_TOKEN=token)) as daemon:
        with WireClient(daemon.port) as c:
            local_port = c.sock.getsockname()[1]
            reply = c.handshake(RELAY, token="wrong")
            assert reply is not None and reply["t"] == messages.REFUSE
            assert "token" in reply["reason"]
            c.rbatch(1, [[agent_sender("s1", 0), 1, steps_body(0, 5)]], peers_for(0))
            assert c.recv() is None  # closed after the refusal
        wait_for(lambda: f"127.0.0.1:{local_port}" in daemon.log(), 20, what="refusal logged")
        with WireClient(daemon.port) as c:
            assert c.handshake(RELAY, token=token)["t"] == messages.ACCEPT
        assert daemon.stop() == 0
    log = daemon.log()
    assert f"refused 127.0.0.1:{local_port}" in log
    assert token not in log
    assert count_steps(db) == 0
    assert daemon_counters(db)["refused_peers"] == 1
    for path in tmp_path.iterdir():
        assert token.encode() not in path.read_bytes()


def test_oversize_frame_closes_only_that_peer(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    a0 = agent_sender("s1", 0)
    with DaemonProcess(db, args=["--max-frame-bytes", "65536"]) as daemon:
        with WireClient(daemon.port) as good, WireClient(daemon.port) as bad:
            assert good.handshake(RELAY)["t"] == messages.ACCEPT
            assert bad.handshake("relay/s1/n1/2-r")["t"] == messages.ACCEPT
            # Only the header: the daemon must refuse before reading the body.
            bad.sock.sendall(struct.pack(">I", 50 * 1024 * 1024))
            assert bad.recv() is None
            good.rbatch(1, [[a0, 1, steps_body(0, 10)]], peers_for(0))
            assert good.recv() == {"t": "ack", "seq": 1}
        assert daemon.stop() == 0
    assert "exceeds the cap" in daemon.log()
    assert daemon_counters(db)["oversize_frames"] == 1
    assert count_steps(db) == 10


def test_silent_peer_is_refused_after_the_hello_timeout(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path / "run.db", args=["--hello-timeout", "0.5"]) as daemon:
        with WireClient(daemon.port) as c:
            assert c.recv()["t"] == messages.CHALLENGE
            reply = c.recv()  # say nothing
            assert reply is not None and reply["t"] == messages.REFUSE
            assert c.recv() is None
        assert daemon.stop() == 0
    assert "no hello" in daemon.log()


def test_agent_may_connect_directly_and_resumes_after_stored_seq(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    sender = agent_sender("s1", 0)
    identity = {"global_rank": 0, "local_rank": 0, "node_rank": 0, "hostname": "h0"}
    with DaemonProcess(db) as daemon:
        with WireClient(daemon.port) as c:
            accept = c.handshake(sender, role=messages.ROLE_AGENT, identity=identity)
            assert accept == {"t": "accept", "v": 1, "last_seq": 0}
            c.send(messages.batch(1, steps_body(0, 4)))
            c.send(messages.batch(2, steps_body(4, 4)))
            assert c.recv()["seq"] == 1 and c.recv()["seq"] == 2
        with WireClient(daemon.port) as c:
            assert c.handshake(sender, role=messages.ROLE_AGENT, identity=identity)["last_seq"] == 2
        assert daemon.stop() == 0
    assert count_steps(db) == 8


def test_kill9_and_restart_on_the_same_db_keeps_counts_exact(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    a0, a1 = agent_sender("s1", 0), agent_sender("s1", 1)
    sent = [[[a0, seq, steps_body(seq * 10, 10)], [a1, seq, steps_body(seq * 10, 10)]] for seq in range(1, 7)]
    daemon = DaemonProcess(db).start()
    try:
        with WireClient(daemon.port) as c:
            assert c.handshake(RELAY)["t"] == messages.ACCEPT
            for i in range(4):
                c.rbatch(i + 1, sent[i], peers_for(0, 1))
            assert [c.recv()["seq"] for _ in range(4)] == [1, 2, 3, 4]
        daemon.kill9()
        daemon.lines.clear()
        daemon.start()
        # The relay never saw acks it trusted: it resends everything, plus new batches.
        with WireClient(daemon.port) as c:
            assert c.handshake(RELAY)["t"] == messages.ACCEPT
            for i in range(6):
                c.rbatch(i + 1, sent[i], peers_for(0, 1))
            assert [c.recv()["seq"] for _ in range(6)] == [1, 2, 3, 4, 5, 6]
        assert daemon.stop() == 0
    finally:
        daemon.stop()
    assert count_steps(db) == 120
    counters = daemon_counters(db)
    assert counters["rows_stored"] == 120
    assert counters["duplicates_discarded"] == 8
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    assert conn.execute("SELECT count(DISTINCT step) FROM steps").fetchone()[0] == 60
    assert conn.execute("SELECT sender, last_seq FROM ranks ORDER BY sender").fetchall() == [(a0, 6), (a1, 6)]
    conn.close()


# --------------------------- the daemon's policy around the conversation


def _hello_frame(session: ServerConnection, token: str | None, role: str = messages.ROLE_RELAY,
                 sender: str = RELAY, identity: dict[str, Any] | None = None) -> bytes:
    mac = auth.hello_mac(token, session.nonce, role, sender)
    return encode_frame(messages.hello(role=role, sender=sender, session="s1",
                                       identity=identity if identity is not None else {"node_rank": 2}, mac=mac))


def _accepted(token: str | None, role: str = messages.ROLE_RELAY, sender: str = RELAY,
              identity: dict[str, Any] | None = None, **kw: Any) -> tuple[ServerConnection, conv.Hello]:
    session = new_connection(token, **kw)
    session.send_challenge()
    (hello,) = session.receive_data(_hello_frame(session, token, role, sender, identity))
    assert isinstance(hello, conv.Hello)
    session.send_accept(0)
    return session, hello


def test_session_accepts_a_good_hello_then_batches_split_anywhere() -> None:
    session = new_connection("tok")
    session.send_challenge()
    a0 = agent_sender("s1", 0)
    stream = _hello_frame(session, "tok") + encode_frame(messages.relay_batch(1, [[a0, 1, b"x"]], {}, {}, {"d": 1}))
    events = [e for i in range(len(stream)) for e in session.receive_data(stream[i : i + 1])]
    assert len(events) == 1 and isinstance(events[0], conv.Hello) and events[0].identity == {"node_rank": 2}
    session.send_accept(0)
    (batch,) = session.receive_data(b"")  # the bytes behind the hello waited for the accept
    assert isinstance(batch, conv.RelayBatch)
    normal = as_batch(events[0], batch)
    assert normal.items == [[a0, 1, b"x"]] and normal.stats == {"d": 1} and normal.seq == 1
    assert session.state is State.OPEN


def test_session_reads_header_then_body_as_the_daemon_does() -> None:
    """The daemon's path: a header, the declared length reserved, then exactly the body."""
    a0 = agent_sender("s1", 0)
    session, hello = _accepted("tok", max_frame_bytes=4096)
    rbatch = encode_frame(messages.relay_batch(1, [[a0, 1, b"x"]], {}, {}, {"d": 1}))
    assert session.receive_data(rbatch[:HEADER_BYTES]) == []
    assert session.next_frame_length == len(rbatch) - HEADER_BYTES
    (batch,) = session.receive_data(rbatch[HEADER_BYTES:])
    assert isinstance(batch, conv.RelayBatch) and as_batch(hello, batch).items == [[a0, 1, b"x"]]
    assert session.frames_received == 2 and session.state is State.OPEN
    (over,) = session.receive_data(struct.pack(">I", 4097))  # over the cap: refused from the header
    assert isinstance(over, conv.ProtocolFailure) and over.oversize and over.declared == 4097
    assert session.state is State.FAILED and session.receive_data(rbatch) == []


def test_session_refuses_a_wrong_mac_and_ignores_what_follows() -> None:
    session = new_connection("tok")
    session.send_challenge()
    events = session.receive_data(_hello_frame(session, "other") + encode_frame(messages.bye()))
    assert len(events) == 1 and isinstance(events[0], conv.BadHello) and "token" in events[0].reason
    assert session.state is State.MUST_REFUSE
    session.send_refuse(events[0].reason)
    assert session.state is State.CLOSED


def test_session_unknown_type_after_hello_fails_that_peer() -> None:
    session, _ = _accepted(None)
    events = session.receive_data(encode_frame({"t": "mystery"}))
    assert isinstance(events[-1], conv.ProtocolFailure) and not events[-1].oversize


def test_session_relay_may_not_send_agent_batches() -> None:
    session, _ = _accepted(None)
    events = session.receive_data(encode_frame(messages.batch(1, b"x")))
    assert isinstance(events[-1], conv.ProtocolFailure)


def test_an_agent_batch_becomes_a_one_item_rbatch_of_its_own() -> None:
    a0 = agent_sender("s1", 0)
    identity = {"global_rank": 0, "node_rank": 1, "hostname": "h1", "world_size": 2}
    session, hello = _accepted("tok", messages.ROLE_AGENT, a0, identity)
    (event,) = session.receive_data(encode_frame(messages.batch(4, b"body")))
    assert isinstance(event, conv.Batch)
    normal = as_batch(hello, event)
    assert (normal.seq, normal.items, normal.peers) == (4, [[a0, 4, b"body"]], {a0: identity})
    assert normal.node == {"node_rank": 1, "hostname": "h1"} and normal.stats == {}


def test_the_tls_hint_names_a_client_hello_only() -> None:
    assert "TLS" in tls_hint(int.from_bytes(b"\x16\x03\x01\x02", "big"))
    assert tls_hint(1 << 20) == "" and tls_hint(None) == ""
