"""Hostile peers against the real daemon process: sockets that never say a hello,
frames that stall halfway, peers that go quiet, frames that would decode into
hundreds of MB, strings that would drive the terminal. Each time the daemon keeps
serving the good peers, and its memory stays bounded."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest

from agent.link import HelloInfo, Link
from tests.support.procs import REPO, DaemonProcess, base_env, free_port, wait_for
from tests.traceml_daemon.net.procfs import MIB, RawPeer, keepalive_armed, peak_rss
from tests.traceml_daemon.wire_client import (
    RELAY,
    WireClient,
    agent_sender,
    count_steps,
    daemon_counters,
    peers_for,
    steps_body,
)
from traceml_wire import messages
from traceml_wire.framing import DEFAULT_MAX_FRAME_BYTES, HEADER_BYTES

TOKEN = "hostile-peers-token-5d1e"


def _relay(daemon: DaemonProcess, port: int, spool: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "relay", "--port", str(port), "--daemon", daemon.address, "--session", "s1",
         "--spool-dir", str(spool), "--flush-timeout", "5"],
        cwd=REPO, env=base_env(TRACEML_TOKEN=TOKEN), stderr=subprocess.PIPE, text=True,
    )
    assert proc.stderr is not None
    line = proc.stderr.readline()  # printed once the agent port is bound
    assert "listening" in line, line
    return proc


def _agent_sends(port: int, batches: int, steps: int) -> None:
    """A real agent link to the relay: numbered batches of ``steps`` steps, all acknowledged."""
    sender = agent_sender("s1", 0)
    hello = HelloInfo(sender=sender, session="s1", identity={"global_rank": 0, "local_rank": 0, "node_rank": 0,
                                                             "world_size": 1})
    link, _ = Link.open("127.0.0.1", port, token=TOKEN, hello=hello, timeout=30.0)
    try:
        for seq in range(1, batches + 1):
            link.send(link.conn.send_batch(seq, steps_body((seq - 1) * steps, steps)))
        acked = 0
        deadline = time.monotonic() + 120.0  # a liveness bound: read_acks waits out its whole window
        while acked < batches:
            assert time.monotonic() < deadline, f"acked {acked} of {batches}"
            acked = max(acked, link.read_acks(0.05))
    finally:
        link.close(bye=True)


# ---------------------------------------------------------------- connection slots


def test_idle_unauthenticated_sockets_at_every_cap_never_keep_a_relay_with_the_token_out(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    # Without a hello a socket keeps its slot for the whole (long) hello timeout.
    args = ["--max-connections", "2", "--max-unauthenticated", "6", "--max-unauthenticated-per-address", "3",
            "--hello-timeout", "300"]
    with DaemonProcess(db, args=args, env=base_env(TRACEML_TOKEN=TOKEN)) as daemon:
        # Three from the relay's own address and three from another: the per-address cap and
        # the unauthenticated cap are both full, and there are more of them than max-connections.
        idle = [RawPeer(daemon.port, source=f"127.0.0.{1 + i % 2}") for i in range(6)]
        try:
            for peer in idle:
                challenge = peer.recv()
                assert challenge is not None and challenge["t"] == messages.CHALLENGE  # admitted, then silent
            relay_port = free_port()
            relay = _relay(daemon, relay_port, tmp_path / "spool")
            try:
                _agent_sends(relay_port, batches=3, steps=10)
                wait_for(lambda: count_steps(db) == 30, 60, what="the relay's batches stored")
            finally:
                relay.terminate()
                relay.communicate(timeout=60)
            assert relay.returncode == 0
            assert "no hello yet and its slot went to a newer peer" in daemon.log()
        finally:
            for peer in idle:
                peer.close()
        assert daemon.stop() == 0
    assert count_steps(db) == 30


# ---------------------------------------------------------------- timeouts


def test_peers_stalled_after_a_frame_header_hold_no_budget_and_are_cut_after_the_read_timeout(
    tmp_path: Path,
) -> None:
    db = tmp_path / "run.db"
    declared = DEFAULT_MAX_FRAME_BYTES - HEADER_BYTES
    with DaemonProcess(db, args=["--read-timeout", "15"]) as daemon:
        stallers = [RawPeer(daemon.port) for _ in range(2)]
        try:
            for i, peer in enumerate(stallers):
                reply = peer.hello(f"relay/s1/n{i + 1}/9-r", role=messages.ROLE_RELAY)
                assert reply is not None and reply["t"] == messages.ACCEPT
                # Two headers that together declare the whole inbound budget, a little of each body.
                peer.stall_inside_a_frame(declared, 1024)
            with WireClient(daemon.port, timeout=60) as good:
                assert good.handshake(RELAY)["t"] == messages.ACCEPT
                good.rbatch(1, [[agent_sender("s1", 0), 1, steps_body(0, 10)]], peers_for(0))
                assert good.recv() == {"t": "ack", "seq": 1}
            # Served while both stalled frames were still open: they held nothing it needed.
            assert all(peer.still_open() for peer in stallers)
            for peer in stallers:
                assert peer.closed_by_server()
        finally:
            for peer in stallers:
                peer.close()
        assert daemon.stop() == 0
    assert daemon.log().count("not complete within the read timeout") == 2
    assert count_steps(db) == 10


def test_peers_stalled_inside_a_frame_are_cut_and_their_budget_serves_the_next_relay(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    # The memory report says how many bytes are reserved: the test waits for the stalled
    # frames to hold the whole budget (the default) before the good relay sends.
    env = base_env(TRACEML_DEBUG_MEM="0.1")
    declared = DEFAULT_MAX_FRAME_BYTES - HEADER_BYTES
    with DaemonProcess(db, args=["--read-timeout", "2"], env=env) as daemon:
        stallers = [RawPeer(daemon.port) for _ in range(2)]
        try:
            for i, peer in enumerate(stallers):
                reply = peer.hello(f"relay/s1/n{i + 1}/9-r", role=messages.ROLE_RELAY)
                assert reply is not None and reply["t"] == messages.ACCEPT
                # Past the part of a body read before the budget is asked: these frames hold it.
                threading.Thread(target=peer.stall_inside_a_frame, args=(declared, 1 << 20), daemon=True).start()
            budget = 2 * (declared + HEADER_BYTES)
            wait_for(lambda: f"inbound_bytes {budget}" in daemon.log(), 60, interval=0.05,
                     what="both stalled frames holding the inbound budget")
            with WireClient(daemon.port, timeout=60) as good:
                assert good.handshake(RELAY)["t"] == messages.ACCEPT
                good.rbatch(1, [[agent_sender("s1", 0), 1, steps_body(0, 10)]], peers_for(0))
                assert good.recv() == {"t": "ack", "seq": 1}
            for peer in stallers:
                assert peer.closed_by_server()
        finally:
            for peer in stallers:
                peer.close()
        assert daemon.stop() == 0
    assert daemon.log().count("not complete within the read timeout") == 2
    assert count_steps(db) == 10
    assert daemon_counters(db)["protocol_errors"] == 2


def test_an_authenticated_peer_that_goes_quiet_is_closed_after_the_idle_timeout(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    with DaemonProcess(db, args=["--idle-timeout", "1"]) as daemon:
        with WireClient(daemon.port, timeout=60) as quiet:
            assert quiet.handshake(RELAY)["t"] == messages.ACCEPT
            quiet.rbatch(1, [[agent_sender("s1", 0), 1, steps_body(0, 5)]], peers_for(0))
            assert quiet.recv() == {"t": "ack", "seq": 1}
            assert quiet.recv() is None  # nothing more from it: closed
        assert daemon.stop() == 0
    assert "no frame within the idle timeout" in daemon.log()
    assert count_steps(db) == 5


def test_keepalive_is_armed_on_the_daemons_side_of_every_peer(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path / "run.db") as daemon:
        with WireClient(daemon.port) as peer:
            assert peer.handshake(RELAY)["t"] == messages.ACCEPT
            client_port = peer.sock.getsockname()[1]
            wait_for(lambda: keepalive_armed(daemon.port, client_port), 20, what="keepalive on the daemon's socket")
        assert daemon.stop() == 0


# ---------------------------------------------------------------- decoded size


def _rbatch_of(items: bytes) -> bytes:
    """An rbatch map whose ``items`` are the packed bytes given."""
    head = b"\x83" + b"".join(msgpack.packb(v) for v in ("t", "rbatch", "seq", 1, "items"))
    return head + items


FOUR_MIB = 4 * MIB
SHAPES = {
    # Four million empty arrays in one array ...
    "flat": _rbatch_of(b"\xdd" + FOUR_MIB.to_bytes(4, "big") + b"\x90" * FOUR_MIB),
    # ... or in arrays that each stay under any per-array cap ...
    "nested": _rbatch_of(b"\xdc\x04\x00" + (b"\xdc\x10\x00" + b"\x90" * 4096) * 1024),
    # ... or one array inside another, a thousand deep, padded to the same size.
    "deep": _rbatch_of(b"\x92" + b"\x91" * 1000 + b"\x90" + msgpack.packb(b"p" * FOUR_MIB)),
}


def test_frames_that_would_decode_into_hundreds_of_mb_fail_their_peer_only(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    with DaemonProcess(db) as daemon:
        assert daemon.proc is not None
        with WireClient(daemon.port, timeout=60) as good:
            assert good.handshake(RELAY)["t"] == messages.ACCEPT
            good.rbatch(1, [[agent_sender("s1", 0), 1, steps_body(0, 10)]], peers_for(0))
            assert good.recv() == {"t": "ack", "seq": 1}
        before = peak_rss(daemon.proc.pid)
        for i, (name, body) in enumerate(SHAPES.items()):
            assert len(body) >= FOUR_MIB, name
            with WireClient(daemon.port, timeout=60) as bad:
                assert bad.handshake(f"relay/s1/n{i + 1}/7-r")["t"] == messages.ACCEPT
                bad.send(body)
                assert bad.recv() is None, name  # failed: the connection is closed
        grown = peak_rss(daemon.proc.pid) - before
        # The next good peer is served as if nothing happened.
        with WireClient(daemon.port, timeout=60) as good:
            assert good.handshake(RELAY)["t"] == messages.ACCEPT
            good.rbatch(1, [[agent_sender("s1", 0), 2, steps_body(10, 10)]], peers_for(0))
            assert good.recv() == {"t": "ack", "seq": 1}
        assert daemon.stop() == 0
    # Decoded in full, the flat frame alone took the daemon hundreds of MB past its peak.
    assert grown < 64 * MIB, f"peak RSS grew by {grown // MIB} MB"
    log = daemon.log()
    assert "over its decode limits" in log and "entries" in log and "nests deeper" in log
    assert count_steps(db) == 20
    assert daemon_counters(db)["protocol_errors"] == 3


# ---------------------------------------------------------------- the log


@pytest.mark.parametrize("where", ["sender", "session"])
def test_strings_from_peers_reach_the_log_escaped(tmp_path: Path, where: str) -> None:
    hostile = "\x1b[2J\x1b]0;owned\x07\nFAKE 2026-01-01 INFO forged line"
    sender = RELAY + hostile if where == "sender" else RELAY
    session = "s1" + hostile if where == "session" else "s1"
    with DaemonProcess(tmp_path / "run.db") as daemon:
        with WireClient(daemon.port) as peer:
            assert peer.handshake(sender, session=session)["t"] == messages.ACCEPT
            peer.send(messages.bye())
            assert peer.recv() is None
        wait_for(lambda: "bye 127.0.0.1" in daemon.log(), 20, what="the bye logged")
        assert daemon.stop() == 0
    log = daemon.log()
    assert "\x1b" not in log and "\x07" not in log
    assert not any(line.startswith("FAKE") for line in log.splitlines())
    assert "\\x1b[2J\\x1b]0;owned\\x07\\x0aFAKE" in log
