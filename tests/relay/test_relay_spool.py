"""Overflow: spill to the spool and replay, spool cap, drop-oldest without a spool."""

from __future__ import annotations

import os
from pathlib import Path

from relay_helpers import FakeAgent, FakeDaemon, body_for, eventually, run

from relay.node import NodeRelay
from relay.spool_file import Packed, Spool
from traceml_wire.spool import MAGIC, scan

TOKEN = "t"
NODE = {"node_rank": 0, "hostname": "h"}
N = 40


async def _fill_while_daemon_down(relay: NodeRelay) -> None:
    """Each agent batch becomes its own rbatch, so the buffer overflows record by record."""
    agent = FakeAgent(relay.port, TOKEN)
    await agent.connect()
    make = body_for("a")
    for seq in range(1, N + 1):
        await agent.send_batches(range(seq, seq + 1), lambda s: make(s) + b"p" * 200)
        relay.upstream.pack()
    await agent.close()


async def _down_port() -> int:
    probe = FakeDaemon(TOKEN)
    await probe.start()
    port = probe.port
    await probe.stop()
    return port


@run
async def test_spill_and_replay_loses_nothing(tmp_path: Path) -> None:
    port = await _down_port()
    relay = NodeRelay(port=0, upstream=("127.0.0.1", port), token=TOKEN, session="s", node=NODE, spool_dir=str(tmp_path), buffer_bytes=2000, flush_interval=0.05)
    async with relay:
        await _fill_while_daemon_down(relay)
        stats = relay.statistics()
        assert stats["spooled_batches"] > 0 and stats["dropped_batches"] == 0
        files = list(tmp_path.iterdir())
        assert files and all(f.read_bytes().startswith(MAGIC) for f in files)
        assert sum(len(scan(f.read_bytes()).records) for f in files) == stats["spooled_batches"]
        daemon = FakeDaemon(TOKEN)
        await daemon.start(port)
        await eventually(lambda: len(daemon.items()) == N and relay.upstream.unacked == 0)
        # Spool first, then memory: the daemon sees every agent batch in order.
        assert [seq for _, seq, _ in daemon.items()] == list(range(1, N + 1))
        all_seqs = [item[1] for rb in daemon.rbatches for item in rb["items"]]
        assert all_seqs == sorted(all_seqs)
        assert relay.statistics()["spool_bytes"] == 0
    assert list(tmp_path.iterdir()) == []  # acked segments are unlinked
    await daemon.stop()


@run
async def test_spool_cap_drops_oldest_and_counts(tmp_path: Path) -> None:
    port = await _down_port()
    relay = NodeRelay(port=0, upstream=("127.0.0.1", port), token=TOKEN, session="s", node=NODE, spool_dir=str(tmp_path), buffer_bytes=2000, spool_bytes=3000, flush_interval=0.05)
    async with relay:
        await _fill_while_daemon_down(relay)
        stats = relay.statistics()
        assert stats["spool_dropped_batches"] > 0
        assert stats["dropped_batches"] == stats["spool_dropped_batches"]
        assert stats["dropped_bytes"] > 0
        daemon = FakeDaemon(TOKEN)
        await daemon.start(port)
        dropped = stats["dropped_batches"]
        await eventually(lambda: relay.upstream.unacked == 0)
        # Oldest went first: what arrives is exactly the newest N - dropped, in order.
        assert [seq for _, seq, _ in daemon.items()] == list(range(dropped + 1, N + 1))
        assert max(rb["stats"]["spool_dropped_batches"] for rb in daemon.rbatches) == dropped
    await daemon.stop()


@run
async def test_without_spool_memory_overflow_drops_oldest_and_counts() -> None:
    port = await _down_port()
    relay = NodeRelay(port=0, upstream=("127.0.0.1", port), token=TOKEN, session="s", node=NODE, spool_dir=None, buffer_bytes=2000, flush_interval=0.05)
    async with relay:
        await _fill_while_daemon_down(relay)
        stats = relay.statistics()
        assert stats["dropped_batches"] > 0 and stats["spooled_batches"] == 0
        daemon = FakeDaemon(TOKEN)
        await daemon.start(port)
        await eventually(lambda: relay.upstream.unacked == 0)
        assert [seq for _, seq, _ in daemon.items()] == list(range(stats["dropped_batches"] + 1, N + 1))
        assert max(rb["stats"]["dropped_batches"] for rb in daemon.rbatches) == stats["dropped_batches"]
    await daemon.stop()


def _packed(seq: int, size: int = 100) -> Packed:
    return Packed(seq, bytes([seq % 256]) * size, 1, size)


def test_spool_unit_append_read_ack(tmp_path: Path) -> None:
    spool = Spool(str(tmp_path), cap_bytes=10_000, segment_bytes=350)
    for seq in range(1, 11):
        spool.append(_packed(seq))
    assert len(spool) == 10 and len(list(tmp_path.iterdir())) > 1  # rolled segments
    got = spool.next_after(0)
    assert got is not None and got.seq == 1 and got.data == _packed(1).data
    assert spool.next_after(4).seq == 5  # type: ignore[union-attr]
    assert spool.next_after(10) is None
    spool.ack(6)
    assert len(spool) == 4 and spool.first_seq() == 7
    spool.ack(10)
    assert len(spool) == 0 and spool.live_bytes == 0
    spool.close()
    assert list(tmp_path.iterdir()) == []


def test_spool_unit_cap_drops_oldest(tmp_path: Path) -> None:
    spool = Spool(str(tmp_path), cap_bytes=3 * 108)
    for seq in range(1, 6):
        spool.append(_packed(seq))
    assert [p.seq for p in spool.dropped] == [1, 2]
    assert spool.first_seq() == 3 and spool.live_bytes <= spool.cap_bytes
    spool.close()


def test_spool_unit_corrupt_record_is_skipped_and_counted(tmp_path: Path) -> None:
    spool = Spool(str(tmp_path), cap_bytes=10_000)
    for seq in range(1, 4):
        spool.append(_packed(seq))
    (path,) = tmp_path.iterdir()
    data = bytearray(path.read_bytes())
    data[len(MAGIC) + 8 + 50] ^= 0xFF  # inside record 1's body
    fd = os.open(path, os.O_WRONLY)
    os.pwrite(fd, bytes(data), 0)
    os.close(fd)
    got = spool.next_after(0)
    assert got is not None and got.seq == 2
    assert [p.seq for p in spool.dropped] == [1]
    spool.close()


@run
async def test_stop_while_daemon_unreachable_keeps_everything_in_spool(tmp_path: Path) -> None:
    from traceml_wire import messages, unpack_message

    port = await _down_port()
    relay = NodeRelay(port=0, upstream=("127.0.0.1", port), token=TOKEN, session="s", node=NODE, spool_dir=str(tmp_path), flush_interval=0.05)
    await relay.start()
    agent = FakeAgent(relay.port, TOKEN)
    await agent.connect()
    await agent.send_batches(range(1, 6), body_for("a"))
    await agent.close()
    await relay.aclose(timeout=0.2)
    files = sorted(tmp_path.iterdir())
    assert files, "nothing left for traceml-daemon ingest"
    items = []
    for path in files:
        result = scan(path.read_bytes())
        assert result.bad_offset is None
        for record in result.records:
            rb = messages.validate_client_message(unpack_message(record))
            assert rb["t"] == "rbatch" and rb["node"] == NODE
            items += [(s, q) for s, q, _ in rb["items"]]
    assert items == [(FakeAgent(0, None).sender, q) for q in range(1, 6)]


def _cli(*args: str) -> str:
    import subprocess
    import sys

    from tests.support.procs import base_env

    done = subprocess.run([sys.executable, "-m", "traceml_daemon", *args], capture_output=True, text=True,
                          env=base_env(), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@run
async def test_spool_cap_drops_reach_the_summary_after_ingest(tmp_path: Path) -> None:
    """The daemon is down for the whole run: the relay's counters exist only in its spool."""
    import json

    from traceml_wire.body import encode_body

    spool_dir = tmp_path / "spool"
    port = await _down_port()
    relay = NodeRelay(port=0, upstream=("127.0.0.1", port), token=TOKEN, session="s", node=NODE, spool_dir=str(spool_dir), buffer_bytes=2000, spool_bytes=3000, flush_interval=0.05)
    await relay.start()
    agent = FakeAgent(relay.port, TOKEN)
    await agent.connect()
    for seq in range(1, N + 1):
        steps = {"step": [seq], "ts": [1_700_000_000.0 + seq], "step_ns": [20_000_000], "model_id": [0]}
        await agent.send_batches(range(seq, seq + 1), lambda s, steps=steps: encode_body({"steps": steps}) + b"")
        relay.upstream.pack()
    await agent.close()
    await relay.aclose(timeout=0.2)
    stats = relay.stats.as_dict()
    assert stats["spool_dropped_batches"] > 0
    db = tmp_path / "run.db"
    files = sorted(map(str, spool_dir.iterdir()))
    _cli("ingest", *files, "--db", str(db))
    delivery = json.loads(_cli("summary", "--db", str(db), "--json"))["delivery"]
    # Everything the relay counted up to its last moment (the spill at stop included).
    assert delivery["relay_spool_dropped_batches"] == stats["spool_dropped_batches"]
    assert delivery["relay_dropped_batches"] == stats["dropped_batches"]
    assert delivery["batches_dropped_reported"] == stats["dropped_batches"]
    assert delivery["rows_stored"] == N - stats["dropped_batches"]
    # A second load of the same spool neither adds rows nor counts the drops twice.
    _cli("ingest", *files, "--db", str(db))
    again = json.loads(_cli("summary", "--db", str(db), "--json"))["delivery"]
    assert again["relay_spool_dropped_batches"] == stats["spool_dropped_batches"]
    assert again["rows_stored"] == delivery["rows_stored"]
