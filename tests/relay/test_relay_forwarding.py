"""End to end through a real NodeRelay: agents -> relay -> fake daemon."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path
from typing import Any

from relay_helpers import FakeAgent, FakeDaemon, body_for, eventually, run

from relay.node import NodeRelay
from traceml_wire import MAX_HELLO_FRAME_BYTES, pack_message
from traceml_wire import messages as wm

TOKEN = "s3cret"
NODE = {"node_rank": 3, "hostname": "nodeA"}


def make_relay(daemon: FakeDaemon, **kw: Any) -> NodeRelay:
    kw.setdefault("spool_dir", None)
    return NodeRelay(port=0, upstream=("127.0.0.1", daemon.port), token=TOKEN, session="s", node=NODE, flush_interval=0.05, **kw)


@run
async def test_batches_forwarded_byte_identical_with_peers_and_node() -> None:
    daemon = FakeDaemon(TOKEN)
    await daemon.start()
    async with make_relay(daemon) as relay:
        agents = [FakeAgent(relay.port, TOKEN, sender=f"s/a0/n3/r{r}/1-aa", identity={"global_rank": r, "local_rank": r}) for r in range(2)]
        sent: dict[tuple[str, int], bytes] = {}
        for agent in agents:
            accept = await agent.connect()
            assert accept["t"] == "accept" and accept["last_seq"] == 0
            make = body_for(agent.sender)
            bodies = {seq: make(seq) for seq in range(1, 6)}
            sent.update({(agent.sender, s): b for s, b in bodies.items()})
            assert await agent.send_batches(range(1, 6), bodies.__getitem__) == [1, 2, 3, 4, 5]
        await eventually(lambda: len(daemon.items()) == 10)
        assert {(s, q): b for s, q, b in daemon.items()} == sent
        for rb in daemon.rbatches:
            assert rb["node"] == NODE
            assert set(rb["peers"]) == {item[0] for item in rb["items"]}
            for sender, identity in rb["peers"].items():
                assert identity["global_rank"] == int(sender.split("/r")[1].split("/")[0])
            assert rb["stats"]["dropped_batches"] == 0
            for key in ("spooled_batches", "spool_dropped_batches", "agents_connected", "refused_agents", "dropped_bytes"):
                assert key in rb["stats"]
        # Items of one sender arrive in seq order; rbatch seqs count up from 1.
        assert [rb["seq"] for rb in daemon.rbatches] == list(range(1, len(daemon.rbatches) + 1))
        hello = daemon.hellos[0]
        assert hello["role"] == "relay" and hello["sender"].startswith("relay/s/n3/")
        assert hello["identity"]["node_rank"] == 3 and hello["identity"]["hostname"] == "nodeA"
        for agent in agents:
            await agent.close()
    await daemon.stop()


@run
async def test_agent_reconnect_gets_last_seq_and_duplicates_are_skipped() -> None:
    daemon = FakeDaemon(TOKEN)
    await daemon.start()
    async with make_relay(daemon) as relay:
        agent = FakeAgent(relay.port, TOKEN)
        await agent.connect()
        await agent.send_batches(range(1, 4), body_for("a"))
        await agent.close()
        again = FakeAgent(relay.port, TOKEN)
        accept = await again.connect()
        assert accept["last_seq"] == 3
        # An agent resending what the relay already holds is acked but not forwarded twice.
        assert await again.send_batches(range(2, 6), body_for("a")) == [2, 3, 4, 5]
        await eventually(lambda: len(daemon.items()) == 5)
        all_items = [item for rb in daemon.rbatches for item in rb["items"]]
        assert [seq for _, seq, _ in all_items] == [1, 2, 3, 4, 5]
        assert relay.statistics()["duplicate_batches"] == 2
        await again.close()
    await daemon.stop()


@run
async def test_unacked_rbatches_resent_after_upstream_drop() -> None:
    daemon = FakeDaemon(TOKEN)
    await daemon.start()
    async with make_relay(daemon) as relay:
        agent = FakeAgent(relay.port, TOKEN)
        await agent.connect()
        daemon.withhold_acks = True
        await agent.send_batches(range(1, 4), body_for("a"))
        await eventually(lambda: len(daemon.items()) == 3)
        assert relay.upstream.unacked >= 1
        first_round = len(daemon.rbatches)
        daemon.withhold_acks = False
        daemon.drop()
        await eventually(lambda: daemon.connections >= 2 and relay.upstream.unacked == 0)
        resent = daemon.rbatches[first_round:]
        # Everything unacked came again, in order, on the new connection.
        assert [item[1] for rb in resent for item in rb["items"]][:3] == [1, 2, 3]
        assert [rb["seq"] for rb in resent] == sorted(rb["seq"] for rb in resent)
        await agent.send_batches(range(4, 6), body_for("a"))
        await eventually(lambda: len(daemon.items()) == 5)
        await agent.close()
    await daemon.stop()


@run
async def test_daemon_down_at_start_then_up_loses_nothing() -> None:
    daemon = FakeDaemon(TOKEN)
    await daemon.start()
    port = daemon.port
    await daemon.stop()  # nothing listens on the port now
    relay = NodeRelay(port=0, upstream=("127.0.0.1", port), token=TOKEN, session="s", node=NODE, flush_interval=0.05)
    async with relay:
        agent = FakeAgent(relay.port, TOKEN)
        await agent.connect()
        await agent.send_batches(range(1, 21), body_for("a"))
        await asyncio.sleep(0.3)
        assert not relay.upstream.connected
        daemon = FakeDaemon(TOKEN)
        await daemon.start(port)
        await eventually(lambda: len(daemon.items()) == 20)
        assert [seq for _, seq, _ in daemon.items()] == list(range(1, 21))
        await agent.close()
    await daemon.stop()


@run
async def test_stop_flushes_pending_data() -> None:
    daemon = FakeDaemon(TOKEN)
    await daemon.start()
    relay = NodeRelay(port=0, upstream=("127.0.0.1", daemon.port), token=TOKEN, session="s", node=NODE, flush_interval=30)
    await relay.start()
    agent = FakeAgent(relay.port, TOKEN)
    await agent.connect()
    await agent.send_batches(range(1, 4), body_for("a"))
    await relay.aclose(timeout=5)  # the packer would not have run for 30 s
    assert [seq for _, seq, _ in daemon.items()] == [1, 2, 3]
    await daemon.stop()


@run
async def test_bad_token_refused() -> None:
    daemon = FakeDaemon(TOKEN)
    await daemon.start()
    async with make_relay(daemon) as relay:
        agent = FakeAgent(relay.port, "wrong")
        reply = await agent.connect()
        assert reply["t"] == "refuse" and "token" in reply["reason"]
        assert await agent.reader.read() == b""  # closed after the refusal
        relay_role = FakeAgent(relay.port, TOKEN)
        reply = await relay_role.connect(role="relay")
        assert reply["t"] == "refuse"
        assert relay.statistics()["refused_agents"] == 2
    await daemon.stop()


@run
async def test_bad_frames_close_only_that_agent() -> None:
    daemon = FakeDaemon(TOKEN)
    await daemon.start()
    async with make_relay(daemon, max_frame_bytes=4096) as relay:
        good = FakeAgent(relay.port, TOKEN, sender="good")
        await good.connect()
        bad_kinds: list[bytes] = [
            struct.pack(">I", 1 << 30),  # over the frame cap
            struct.pack(">I", 3) + b"\xc1\xc1\xc1",  # not msgpack
            pack_message({"t": "teleport"}),  # unknown type
            pack_message({"t": "batch", "seq": "x", "body": b""}),  # wrong type
        ]
        for i, raw in enumerate(bad_kinds):
            bad = FakeAgent(relay.port, TOKEN, sender=f"bad{i}")
            await bad.connect()
            bad.writer.write(raw if i < 2 else struct.pack(">I", len(raw)) + raw)
            assert await bad.reader.read() == b""
        await eventually(lambda: relay.statistics()["agent_protocol_errors"] == 4)
        assert await good.send_batches(range(1, 3), body_for("good")) == [1, 2]
        await eventually(lambda: len(daemon.items()) == 2)
        await good.close()
    await daemon.stop()


@run
async def test_large_frame_before_the_hello_is_refused_and_the_full_cap_applies_after() -> None:
    daemon = FakeDaemon(TOKEN)
    await daemon.start()
    async with make_relay(daemon) as relay:
        # Before its hello a peer may declare only a hello-sized frame: 1 MiB is refused
        # from the header alone, nothing of it buffered, and only that peer is closed.
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        await reader.read(1024)  # the challenge
        writer.write(struct.pack(">I", 1 << 20) + b"x" * 1024)
        refusal = await asyncio.wait_for(reader.read(), 10.0)  # read to EOF: the relay closed
        assert b"refuse" in refusal and str(MAX_HELLO_FRAME_BYTES).encode() in refusal
        writer.close()
        assert relay.statistics()["refused_agents"] == 1
        # An accepted agent may send a batch far over the hello cap.
        agent = FakeAgent(relay.port, TOKEN, sender="big")
        await agent.connect()
        padded = {1: pack_message({"tables": {}, "pad": b"p" * (4 * MAX_HELLO_FRAME_BYTES)})}
        assert await agent.send_batches(range(1, 2), padded.__getitem__) == [1]
        await eventually(lambda: len(daemon.items()) == 1)
        await agent.close()
    await daemon.stop()


@run
async def test_unknown_fields_in_hello_and_batch_are_ignored() -> None:
    daemon = FakeDaemon(TOKEN)
    await daemon.start()
    async with make_relay(daemon) as relay:
        agent = FakeAgent(relay.port, TOKEN, identity={"global_rank": 1, "future": [1]})
        await agent.connect()
        agent.send({**wm.batch(1, b"x"), "new_field": {"a": 1}})
        assert (await agent.read())["seq"] == 1
        await eventually(lambda: len(daemon.items()) == 1)
        assert daemon.rbatches[0]["peers"][agent.sender] == {"global_rank": 1}
        await agent.close()
    await daemon.stop()


@run
async def test_hello_timeout_closes_silent_agent() -> None:
    daemon = FakeDaemon(TOKEN)
    await daemon.start()
    async with make_relay(daemon, hello_timeout=0.2) as relay:
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        data = await reader.read()  # challenge, then refuse, then EOF
        assert b"refuse" in data and b"timeout" in data
        writer.close()
    await daemon.stop()


def test_non_loopback_without_token_refused(tmp_path: Path) -> None:
    try:
        NodeRelay(port=0, host="0.0.0.0", token=None, session="s", node=NODE)
    except ValueError as exc:
        assert "token" in str(exc)
    else:
        raise AssertionError("expected ValueError")


def _span_body(size: int) -> bytes:
    """A valid agent body of exactly ``size`` bytes: one span whose args fill it."""
    from traceml_wire.body import encode_body
    from traceml_wire.tables import columns

    def body(args: str) -> bytes:
        # Every column of today's table, as the agent sends it (the unset ones None).
        span: dict[str, list[object]] = {name: [None] for name in columns("spans")}
        span.update(name=["big"], start_ns=[1], dur_ns=[2], step=[0], args=[args])
        return encode_body({"spans": span}, sent_ts=1.0)

    # Past 64 KiB a string's header is 5 bytes (str32): the size is linear in the length.
    filler = size - len(body("x" * 70_000)) + 70_000
    out = body("x" * filler)
    assert len(out) == size
    return out


def test_a_max_size_agent_body_passes_through_the_relay_into_the_daemon(tmp_path: Path) -> None:
    """The largest body the agent sends whole is accepted by the relay and, wrapped in an
    rbatch, by the real daemon under its default frame cap; stored, not refused."""
    from agent.sender import MAX_BODY_BYTES, encode_bodies
    from tests.support.procs import DaemonProcess, base_env, wait_for
    from traceml_wire.tables import decode_body

    body = _span_body(MAX_BODY_BYTES)
    # The agent ships it as one body (one byte more and it could not be sent at all).
    assert encode_bodies(decode_body(body), 1.0) == ([body], 0)
    db = tmp_path / "run.db"

    async def forward(port: int) -> None:
        relay = NodeRelay(port=0, upstream=("127.0.0.1", port), token=TOKEN, session="s", node=NODE, spool_dir=None, flush_interval=0.05)
        async with relay:
            agent = FakeAgent(relay.port, TOKEN, sender="s/a0/n3/r0/1-aa")
            assert (await agent.connect())["t"] == "accept"
            assert await agent.send_batches(range(1, 2), lambda _: body) == [1]
            await eventually(lambda: relay.stats.rbatches_acked >= 1, timeout=60)
            assert relay.stats.agent_protocol_errors == 0 and relay.stats.dropped_batches == 0
            await agent.close()

    def stored() -> int:
        import sqlite3

        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            return conn.execute("SELECT length(args) FROM spans WHERE name='big'").fetchone()[0]
        finally:
            conn.close()

    with DaemonProcess(db, env=base_env(TRACEML_TOKEN=TOKEN)) as daemon:
        asyncio.run(asyncio.wait_for(forward(daemon.port), 120))
        # The daemon acks an rbatch only after its rows committed.
        assert wait_for(stored, 30, what="the span stored") == len(decode_body(body)["spans"]["args"][0])
        assert "oversize" not in daemon.log().lower()
