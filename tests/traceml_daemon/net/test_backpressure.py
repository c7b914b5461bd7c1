"""A stalled writer pauses reading (the byte-bounded queue fills, the handler
stops reading its socket) and, once it resumes, loses nothing: the real server
on a real socket, with the writer blocked through its test hook."""

from __future__ import annotations

import asyncio
import sqlite3
from dataclasses import replace
from pathlib import Path

from tests.traceml_daemon.wire_client import RELAY, WireClient, agent_sender, steps_body
from traceml_daemon.net.limits import DAEMON_LIMITS
from traceml_daemon.net.server import DaemonServer, ServerConfig
from traceml_wire import messages

BATCHES = 300


def test_stalled_writer_pauses_reading_and_loses_nothing(tmp_path: Path) -> None:
    db = tmp_path / "bp.db"
    sender = agent_sender("s1", 0)

    async def go() -> None:
        server = DaemonServer(ServerConfig(db_path=str(db), port=0, queue_bytes=16 * 1024))
        gate = asyncio.Event()
        stalls = 0

        async def stall() -> None:
            nonlocal stalls
            stalls += 1
            await gate.wait()

        server.writer.before_write = stall
        stop = asyncio.Event()
        task = asyncio.create_task(server.serve(stop))
        while server.bound is None:
            await asyncio.sleep(0.01)
        port = server.bound[1]

        def client() -> list[int]:
            with WireClient(port, timeout=60) as c:
                assert c.handshake(RELAY)["t"] == messages.ACCEPT
                for seq in range(1, BATCHES + 1):
                    c.rbatch(seq, [[sender, seq, steps_body((seq - 1) * 100, 100)]], {sender: {"global_rank": 0}})
                acks = []
                while not acks or acks[-1] < BATCHES:
                    msg = c.recv()
                    assert msg is not None and msg["t"] == "ack"
                    acks.append(msg["seq"])
                return acks

        sending = asyncio.create_task(asyncio.to_thread(client))
        # The writer is stalled: the queue fills to its bound and stays there.
        for _ in range(200):
            await asyncio.sleep(0.02)
            if server.queue.bytes_held >= server.queue.max_bytes // 2 and stalls:
                break
        await asyncio.sleep(0.3)
        held = server.queue.bytes_held
        assert 0 < held <= server.queue.max_bytes + 64 * 1024  # bounded (one oversize item may pass alone)
        assert server.counters.frames_received < BATCHES + 1  # reading paused: not every frame was read
        assert not sending.done()  # no acks while nothing is committed
        gate.set()
        acks = await asyncio.wait_for(sending, 60)
        assert acks[-1] == BATCHES
        stop.set()
        await task

    asyncio.run(go())
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    assert conn.execute("SELECT count(*), count(DISTINCT step) FROM steps").fetchone() == (BATCHES * 100, BATCHES * 100)


def test_many_connections_hold_at_most_the_inbound_budget_while_the_writer_is_stalled(tmp_path: Path) -> None:
    """Each blocked handler used to keep the frames it had read: memory grew with
    the number of connections. Now frames are read only under the shared budget."""
    db = tmp_path / "many.db"
    conns, frames, steps = 8, 6, 2000

    async def go() -> None:
        budget = 300 * 1024
        server = DaemonServer(ServerConfig(db_path=str(db), port=0, queue_bytes=64 * 1024,
                                           limits=replace(DAEMON_LIMITS, inbound_bytes=budget)))
        gate = asyncio.Event()
        server.writer.before_write = gate.wait
        stop = asyncio.Event()
        task = asyncio.create_task(server.serve(stop))
        while server.bound is None:
            await asyncio.sleep(0.01)
        port = server.bound[1]

        def client(c_id: int) -> int:
            sender = agent_sender("s1", c_id)
            with WireClient(port, timeout=60) as c:
                assert c.handshake(f"relay-{c_id}")["t"] == messages.ACCEPT
                for seq in range(1, frames + 1):
                    body = steps_body((seq - 1) * steps, steps)
                    assert len(body) < budget // 2  # every frame fits the budget: none passes alone
                    c.rbatch(seq, [[sender, seq, body]], {sender: {"global_rank": c_id}})
                last = 0
                while last < frames:
                    msg = c.recv()
                    assert msg is not None and msg["t"] == "ack"
                    last = msg["seq"]
                return last

        sending = [asyncio.create_task(asyncio.to_thread(client, i)) for i in range(conns)]
        for _ in range(300):
            await asyncio.sleep(0.02)
            if server.inbound.statistics()["waiters"] >= 2:
                break
        await asyncio.sleep(0.3)
        stats = server.inbound.statistics()
        assert stats["waits"] > 0 and stats["waiters"] > 0  # handlers wait for bytes, not read ahead
        assert stats["peak_bytes"] <= budget
        assert server.counters.frames_received < conns * (frames + 1)  # not everything was read
        gate.set()
        assert await asyncio.wait_for(asyncio.gather(*sending), 60) == [frames] * conns
        assert server.inbound.bytes_held == 0 and server.inbound.peak_bytes <= budget
        stop.set()
        await task

    asyncio.run(go())
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    assert conn.execute("SELECT count(*) FROM steps").fetchone() == (conns * frames * steps,)
