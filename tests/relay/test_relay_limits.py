"""The relay's connection limits with real processes: ``traceml-relay`` between real
agents' links (and hostile sockets) and a real ``traceml-daemon serve``. The relay
bounds its agents as the daemon bounds its peers: connection caps, one inbound byte
budget, read and idle timeouts, keepalive, and lines a peer can repeat held to a
rate on the stderr it shares with a trainer."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from agent.link import HelloInfo, Link
from relay.upstream import Upstream
from tests.support.procs import REPO, DaemonProcess, base_env, free_port, wait_for
from tests.traceml_daemon.net.procfs import MIB, RawPeer, keepalive_armed, keepalive_armed_towards, peak_rss
from tests.traceml_daemon.wire_client import agent_sender, count_steps, steps_body
from traceml_wire import messages
from traceml_wire.framing import MAX_AGENT_FRAME_BYTES, MAX_RBATCH_ITEMS

TOKEN = "relay-limits-token-2b7c"
HELLO = HelloInfo(sender=agent_sender("s1", 0), session="s1",
                  identity={"global_rank": 0, "local_rank": 0, "node_rank": 0, "world_size": 1})


class Relay:
    """``python -m relay`` on a free port, its stderr kept."""

    def __init__(self, daemon: DaemonProcess, spool: Path, *args: str, token: str | None = None) -> None:
        self.port = free_port()
        env = base_env(TRACEML_TOKEN=token) if token else base_env()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "relay", "--port", str(self.port), "--daemon", daemon.address, "--session", "s1",
             "--spool-dir", str(spool), "--flush-timeout", "5", *args],
            cwd=REPO, env=env, stderr=subprocess.PIPE, text=True,
        )
        assert self.proc.stderr is not None
        line = self.proc.stderr.readline()  # printed once the agent port is bound
        assert "listening" in line, line
        self.err = ""

    def stop(self) -> str:
        """Stop it (SIGTERM, a clean flush) and return what it wrote on stderr."""
        if self.proc.poll() is None:
            self.proc.terminate()
        self.err += self.proc.communicate(timeout=60)[1]
        assert self.proc.returncode == 0, self.err
        return self.err


class Agent:
    """A real agent link (agent.link.Link), numbering its batches of steps."""

    def __init__(self, port: int, token: str | None) -> None:
        self.link, _ = Link.open("127.0.0.1", port, token=token, hello=HELLO, timeout=30.0)
        self.seq = 0

    def send(self, batches: int, steps: int = 10) -> None:
        """``batches`` more batches, each acknowledged before this returns."""
        first = self.seq
        for _ in range(batches):
            self.seq += 1
            self.link.send(self.link.conn.send_batch(self.seq, steps_body(self.seq * steps, steps)))
        acked = first
        deadline = time.monotonic() + 120.0  # a liveness bound: read_acks waits out its whole window
        while acked < self.seq:
            assert time.monotonic() < deadline, f"acked {acked} of {self.seq}"
            acked = max(acked, self.link.read_acks(0.05))

    def close(self) -> None:
        self.link.close(bye=True)


def test_stalled_frames_at_the_agent_cap_keep_the_relay_small_and_a_good_agent_delivers(tmp_path: Path) -> None:
    """Eight loopback sockets each send one byte less than the agent frame cap and stall:
    the relay reads one at a time under its byte budget and cuts each after the read
    timeout, instead of holding all eight."""
    db = tmp_path / "run.db"
    with DaemonProcess(db) as daemon:
        relay = Relay(daemon, tmp_path / "spool", "--read-timeout", "1")
        attackers: list[RawPeer] = []
        try:
            good = Agent(relay.port, None)
            good.send(1)
            wait_for(lambda: count_steps(db) == 10, 60, what="the first batch stored")
            before = peak_rss(relay.proc.pid)
            for i in range(8):
                peer = RawPeer(relay.port)
                reply = peer.hello(agent_sender("s1", 100 + i))
                assert reply is not None and reply["t"] == messages.ACCEPT
                attackers.append(peer)
                threading.Thread(target=peer.stall_inside_a_frame,
                                 args=(MAX_AGENT_FRAME_BYTES, MAX_AGENT_FRAME_BYTES - 1), daemon=True).start()
            good.send(3)  # behind the stalled frames in the budget's queue, served as each is cut
            wait_for(lambda: count_steps(db) == 40, 120, what="the good agent's batches stored")
            for peer in attackers:
                assert peer.closed_by_server()
            grown = peak_rss(relay.proc.pid) - before
            good.close()
        finally:
            for peer in attackers:
                peer.close()
            err = relay.stop()
        # Unbounded, the eight frames took the relay more than a hundred MB past its peak.
        assert grown < 40 * MIB, f"relay peak RSS grew by {grown // MIB} MB"
        assert daemon.stop() == 0
    assert count_steps(db) == 40
    # Eight agents cut for a stalled frame: one line, not eight, on the stderr a trainer shares.
    closing = [line for line in err.splitlines() if "closing agent connection" in line]
    assert len(closing) == 1 and "read timeout" in closing[0], err


def test_sockets_without_a_hello_are_held_to_the_caps_and_an_agent_with_the_token_gets_in(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    with DaemonProcess(db, env=base_env(TRACEML_TOKEN=TOKEN)) as daemon:
        relay = Relay(daemon, tmp_path / "spool", "--max-unauthenticated", "4",
                      "--max-unauthenticated-per-address", "4", "--hello-timeout", "300", token=TOKEN)
        idle = [RawPeer(relay.port) for _ in range(8)]
        try:
            # Eight silent sockets, four slots: each newcomer took the oldest one's slot.
            seen: set[int] = set()

            def held_to_the_cap() -> bool:
                return sum(_closed(peer, seen) for peer in idle) >= 4

            wait_for(held_to_the_cap, 60, what="the relay closing sockets over its cap")
            agent = Agent(relay.port, TOKEN)  # admitted at once, in the slot of the oldest silent socket
            agent.send(2)
            agent.close()
            wait_for(lambda: count_steps(db) == 20, 60, what="its batches stored")
        finally:
            for peer in idle:
                peer.close()
            err = relay.stop()
        assert daemon.stop() == 0
    refused = [line for line in err.splitlines() if "refused an agent" in line]
    assert len(refused) == 1, err  # however many it closed, once on stderr


def _closed(peer: RawPeer, seen: set[int]) -> bool:
    """Has the relay refused or closed this socket? (Never blocks; ``seen`` remembers.)"""
    if id(peer) in seen:
        return True
    peer.sock.setblocking(False)
    try:
        while True:
            data = peer.sock.recv(65536)
            if not data or b"refuse" in data:
                break
    except BlockingIOError:
        return False
    except OSError:
        pass
    finally:
        peer.sock.setblocking(True)
    seen.add(id(peer))
    return True


def test_a_quiet_agent_is_closed_after_the_idle_timeout_and_links_are_kept_alive(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    with DaemonProcess(db) as daemon:
        relay = Relay(daemon, tmp_path / "spool", "--idle-timeout", "1")
        try:
            agent = Agent(relay.port, None)
            agent.send(1)
            agent_port = agent.link.sock.getsockname()[1]
            # Keepalive on the relay's side of the agent's link and on its own link to the daemon.
            wait_for(lambda: keepalive_armed(relay.port, agent_port), 30, what="keepalive on the relay's agent link")
            wait_for(lambda: keepalive_armed_towards(daemon.port), 30, what="keepalive on the relay's daemon link")
            agent.link.sock.settimeout(60)
            assert agent.link.sock.recv(1) == b""  # it said nothing more: the relay closed it
            agent.link.close(bye=False)
            wait_for(lambda: count_steps(db) == 10, 60, what="its batch stored")
        finally:
            relay.stop()
        assert daemon.stop() == 0


def test_a_relay_whose_quiet_daemon_link_is_closed_reconnects_without_a_word(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    with DaemonProcess(db, args=["--idle-timeout", "1"]) as daemon:
        relay = Relay(daemon, tmp_path / "spool")
        try:
            agent = Agent(relay.port, None)
            agent.send(1)
            wait_for(lambda: count_steps(db) == 10, 60, what="the first batch stored")
            # Nothing to forward: the daemon closes the relay's link, more than once.
            wait_for(lambda: daemon.log().count("no frame within the idle timeout") >= 2, 60,
                     what="the daemon closing the quiet relay twice")
            agent.send(2)
            wait_for(lambda: count_steps(db) == 30, 60, what="later batches stored")
            agent.close()
        finally:
            err = relay.stop()
        assert daemon.stop() == 0
    assert "unreachable" not in err and "dropped" not in err, err


def test_an_rbatch_holds_at_most_the_items_the_daemon_decodes() -> None:
    upstream = Upstream(daemon=("127.0.0.1", 9), token=None, session="s", node={}, spool_dir=None)
    for seq in range(1, MAX_RBATCH_ITEMS + 2):
        upstream.put("a", seq, b"")  # empty bodies never reach the byte threshold
    upstream.pack()
    counts = [packed.n_items for packed in upstream._memory]
    assert counts == [MAX_RBATCH_ITEMS, 1]


def test_a_peers_strings_reach_the_relays_stderr_escaped(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    with DaemonProcess(db) as daemon:
        relay = Relay(daemon, tmp_path / "spool")
        try:
            peer = RawPeer(relay.port)
            reply = peer.hello("s1/a0/n0/r5/1-x\x1b[2J\nFAKE line")
            assert reply is not None and reply["t"] == messages.ACCEPT
            peer.sock.sendall(b"\x00\x00\x00\x01\xc1")  # not msgpack: the relay closes it and says why
            assert peer.closed_by_server()
            peer.close()
        finally:
            err = relay.stop()
        assert daemon.stop() == 0
    assert "\x1b" not in err and not any(line.startswith("FAKE") for line in err.splitlines()), err
    assert "r5/1-x\\x1b[2J\\x0aFAKE line" in err

