"""A small blocking client that speaks the real wire to a real daemon (tests only)."""

from __future__ import annotations

import asyncio
import socket
import sqlite3
from pathlib import Path
from typing import Any

from relay._frames import Wire
from traceml_wire import auth, messages
from traceml_wire import connection_events as conv
from traceml_wire.body import encode_body
from traceml_wire.client_connection import ClientConnection
from traceml_wire.framing import FrameDecoder, encode_frame, unpack_message

# The sender id the tests' relay connections present in their hello.
RELAY = "relay/s1/n0/1-r"


def agent_sender(session: str, rank: int, node: int = 0, attempt: int = 0) -> str:
    return f"{session}/a{attempt}/n{node}/r{rank}/1000-abcd"


def steps_body(first: int, n: int, step_ns: int = 20_000_000, rss: int = 1 << 30) -> bytes:
    steps = list(range(first, first + n))
    cols: dict[str, list[Any]] = {
        "step": steps,
        "ts": [1_700_000_000.0 + s for s in steps],
        "step_ns": [step_ns] * n,
        "dataloader_ns": [2_000_000] * n,
        "h2d_ns": [100_000] * n,
        "forward_ns": [6_000_000] * n,
        "backward_ns": [9_000_000] * n,
        "optimizer_ns": [2_000_000] * n,
        "wait_ns": [900_000] * n,
        "rss_bytes": [rss] * n,
    }
    return encode_body({"steps": cols}, sent_ts=1_700_000_000.0)


class WireClient:
    def __init__(self, port: int, host: str = "127.0.0.1", timeout: float = 20.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.decoder = FrameDecoder()
        self.pending: list[bytes] = []

    def recv(self) -> dict[str, Any] | None:
        """Next message, or None when the daemon closed the connection."""
        while not self.pending:
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:
                return None  # closed while our last bytes were in flight: still "closed"
            if not data:
                return None
            self.pending.extend(self.decoder.feed(data))
        return messages.validate_server_message(unpack_message(self.pending.pop(0)))

    def send(self, message: dict[str, Any] | bytes) -> None:
        self.sock.sendall(encode_frame(message))

    def handshake(
        self, sender: str, token: str | None = None, role: str = messages.ROLE_RELAY, session: str = "s1",
        identity: dict[str, Any] | None = None,
    ) -> dict[str, Any] | None:
        challenge = self.recv()
        assert challenge is not None and challenge["t"] == messages.CHALLENGE
        mac = auth.hello_mac(token, challenge["nonce"], role, sender)
        cnonce = auth.new_nonce()
        self.send(messages.hello(role=role, sender=sender, session=session, identity=identity or {}, mac=mac,
                                 cnonce=cnonce))
        reply = self.recv()
        if reply is not None and reply["t"] == messages.ACCEPT and token:
            # The daemon proves the token back (mutual authentication).
            assert auth.verify_accept_proof(token, cnonce, challenge["nonce"], role, sender, reply["last_seq"],
                                            reply.get("proof")), "the daemon's accept does not prove the token"
        return reply

    def rbatch(
        self, seq: int, items: list[list[Any]], peers: dict[str, dict[str, Any]], node: dict[str, Any] | None = None,
        stats: dict[str, int] | None = None,
    ) -> None:
        self.send(messages.relay_batch(seq, items, peers, node or {"node_rank": 0, "hostname": "h0"}, stats or {}))

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> WireClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def count_steps(db: Path) -> int:
    """Step rows stored in ``db`` (read-only, beside a live daemon)."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT count(*) FROM steps").fetchone()[0]
    finally:
        conn.close()


def daemon_counters(db: Path) -> dict[str, int]:
    """The daemon's own delivery counters as stored in ``db``."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return dict(conn.execute("SELECT counter, value FROM delivery WHERE source='daemon'").fetchall())
    finally:
        conn.close()


def peers_for(*ranks: int) -> dict[str, dict[str, int]]:
    """An rbatch's peers map for agents of session s1, node 0, with these global ranks."""
    return {agent_sender("s1", r): {"global_rank": r, "local_rank": r, "node_rank": 0, "world_size": len(ranks)}
            for r in ranks}


async def connect_agent(port: int, token: str, session: str, rank: int,
                        caps: tuple[str, ...] = (messages.CAP_CONTROL,)) -> tuple[Wire, str]:
    """An agent of ``rank`` through the real sans-I/O client on an asyncio socket, accepted
    (it lists ``caps`` in its hello); returns its wire and sender id."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    wire = Wire(reader, writer, ClientConnection(token))
    sender = agent_sender(session, rank)
    while True:
        (event,) = await wire.events()
        if isinstance(event, conv.Challenge):
            await wire.send(wire.conn.send_hello(role=messages.ROLE_AGENT, sender=sender, session=session,
                                                 identity={"session": session, "global_rank": rank}, caps=caps))
        else:
            assert isinstance(event, conv.Accepted), event
            return wire, sender
