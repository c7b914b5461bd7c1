"""Control requests routed daemon -> relay -> agent, with the real daemon server and the
real relay on real sockets: only the agent of the rank asked gets the request, an agent
that never listed the capability gets nothing (the relay drops and counts it, the agent's
stream goes on), and a rank no connection carries is refused with the ranks that are."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from relay._frames import Wire
from relay.node import NodeRelay
from tests.traceml_daemon.wire_client import connect_agent, steps_body
from traceml_daemon.net.routes import RouteError
from traceml_daemon.net.server import DaemonServer, ServerConfig
from traceml_wire import connection_events as conv
from traceml_wire import messages

TOKEN = "ctl-s3cret"
SESSION = "s1"


async def _batch(wire: Wire, seq: int) -> list[conv.Event]:
    """Send batch ``seq``; every event up to and including its ack."""
    await wire.send(wire.conn.send_batch(seq, steps_body(seq * 10, 10)))
    seen: list[conv.Event] = []
    while not any(isinstance(e, conv.Ack) and e.seq == seq for e in seen):
        seen += await wire.events()
    return seen


def test_a_request_reaches_only_the_rank_asked(tmp_path: Path) -> None:
    async def go() -> None:
        server = DaemonServer(ServerConfig(db_path=str(tmp_path / "ctl.db"), port=0, token=TOKEN))
        stop = asyncio.Event()
        serving = asyncio.create_task(server.serve(stop))
        while server.bound is None:
            await asyncio.sleep(0.01)
        relay = NodeRelay(port=0, upstream=("127.0.0.1", server.bound[1]), token=TOKEN, session=SESSION,
                          node={"node_rank": 0}, spool_dir=None, flush_interval=0.02)
        await relay.start()
        try:
            agents = [await connect_agent(relay.port, TOKEN, SESSION, rank, caps) for rank, caps in
                      ((0, (messages.CAP_CONTROL,)), (1, (messages.CAP_CONTROL,)), (2, ()))]
            for wire, _ in agents:
                await _batch(wire, 1)
            routes = server.peers.routes
            for _ in range(500):  # the relay forwards within its flush interval
                if sorted(routes.ranks(SESSION).get(SESSION, [])) == [0, 1, 2]:
                    break
                await asyncio.sleep(0.01)
            assert sorted(routes.ranks(SESSION)[SESSION]) == [0, 1, 2]

            sent = routes.send(SESSION, 1, 3, "0123abcd")
            assert sent.sender == agents[1][1]
            (event,) = await agents[1][0].events()
            assert event == conv.Control(messages.OP_PROFILE, agents[1][1], 3, "0123abcd")
            # Rank 0's stream holds nothing but its ack: the request went to rank 1 alone.
            assert [type(e) for e in await _batch(agents[0][0], 2)] == [conv.Ack]

            # An agent without the capability: the relay drops the request and counts it.
            routes.send(SESSION, 2, 3, "4567abcd")
            for _ in range(500):
                if relay.statistics()["controls_dropped"]:
                    break
                await asyncio.sleep(0.01)
            assert relay.statistics()["controls_dropped"] == 1
            assert relay.statistics()["controls_forwarded"] == 1
            assert [type(e) for e in await _batch(agents[2][0], 2)] == [conv.Ack]

            with pytest.raises(RouteError, match=r"rank 9 .* not connected .*ranks \[0, 1, 2\]"):
                routes.send(SESSION, 9, 3, "89abcdef")
            for wire, _ in agents:
                await wire.close()
        finally:
            await relay.aclose()
            stop.set()
            await serving

    asyncio.run(go())
