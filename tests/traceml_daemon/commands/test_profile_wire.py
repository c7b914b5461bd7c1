"""`traceml-daemon profile --daemon HOST:PORT`: the control client against the real daemon
server on a real socket, with a token. An agent connected straight to the daemon (its own
relay) gets the request; a wrong token, a rank no connection carries and a closed port
each come back as an error that says what to do; the connection of a client that breaks
the protocol is closed and counted, the daemon goes on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from relay._frames import Wire
from tests.traceml_daemon.wire_client import connect_agent, steps_body
from traceml_daemon.commands.profile_wire import WireError, ask
from traceml_daemon.net.server import DaemonServer, ServerConfig
from traceml_wire import connection_events as conv
from traceml_wire import messages
from traceml_wire.client_connection import ClientConnection
from traceml_wire.framing import encode_frame

TOKEN = "wire-s3cret"
SESSION = "s1"


async def _agent(port: int, rank: int) -> tuple[Wire, str]:
    """An agent straight on the daemon, its first batch acknowledged (so a route names it)."""
    wire, sender = await connect_agent(port, TOKEN, SESSION, rank)
    await wire.send(wire.conn.send_batch(1, steps_body(0, 5)))
    (ack,) = await wire.events()
    assert ack == conv.Ack(1)
    return wire, sender


def test_the_control_client_asks_the_daemon_and_the_agent_gets_the_request(tmp_path: Path) -> None:
    async def go() -> None:
        server = DaemonServer(ServerConfig(db_path=str(tmp_path / "w.db"), port=0, token=TOKEN))
        stop = asyncio.Event()
        serving = asyncio.create_task(server.serve(stop))
        while server.bound is None:
            await asyncio.sleep(0.01)
        address = f"127.0.0.1:{server.bound[1]}"
        try:
            wire, sender = await _agent(server.bound[1], 3)
            answer = await asyncio.to_thread(ask, address, TOKEN, 3, 4, "00ff00ff", SESSION)
            assert (answer.status, answer.sender, answer.session) == ("sent", sender, SESSION)
            (event,) = await wire.events()
            assert event == conv.Control(messages.OP_PROFILE, sender, 4, "00ff00ff")

            missing = await asyncio.to_thread(ask, address, TOKEN, 5, 4, "11ff00ff", SESSION)
            assert missing.status == "refused" and "rank 5 of session s1 is not connected" in missing.message

            with pytest.raises(WireError, match="refused: .*token.*same TRACEML_TOKEN"):
                await asyncio.to_thread(ask, address, "wrong", 3, 4, "22ff00ff", SESSION)
            errors = server.counters.protocol_errors

            def hostile() -> None:
                """A control client that sends a batch: closed, counted."""
                import socket

                conn = ClientConnection(TOKEN)
                with socket.create_connection(("127.0.0.1", server.bound[1]), timeout=5) as sock:  # type: ignore[index]
                    conn.receive_data(sock.recv(4096))
                    sock.sendall(conn.send_hello(role="control", sender="control/x", session="", identity={}))
                    conn.receive_data(sock.recv(4096))
                    sock.sendall(encode_frame(messages.batch(1, b"x")))
                    assert sock.recv(4096) == b""  # closed

            await asyncio.to_thread(hostile)
            assert server.counters.protocol_errors == errors + 1
            again = await asyncio.to_thread(ask, address, TOKEN, 3, 2, "33ff00ff", SESSION)
            assert again.status == "sent"
            await wire.close()
        finally:
            stop.set()
            await serving

    asyncio.run(go())


def test_a_closed_port_says_the_daemon_is_not_reachable() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(WireError, match="not reachable .*traceml-daemon serve"):
        ask(f"127.0.0.1:{port}", TOKEN, 0, 3, "44ff00ff", None)
