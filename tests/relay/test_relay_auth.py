"""Mutual authentication with real processes: a real daemon (``traceml-daemon
serve``) and real relays with a token, against a squatter on the agent's relay
port, a daemon holding another token, and a squatter on the daemon's port."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from relay_helpers import FakeAgent, FakeDaemon, body_for, eventually, run

from agent.errors import ErrorReporter
from agent.sender import HelloInfo, Sender
from relay.node import NodeRelay, start_relay_thread
from tests.support.procs import REPO, DaemonProcess, base_env, free_port, wait_for
from tests.traceml_daemon.wire_client import count_steps, daemon_counters
from traceml_wire import FrameDecoder, encode_frame, unpack_message
from traceml_wire import messages as wm

TOKEN = "mutual-auth-token-7f3a"
NODE = {"node_rank": 0, "hostname": "h0"}
HELLO = HelloInfo(sender="auth/a0/n0/r0/1-abc", session="auth",
                  identity={"global_rank": 0, "local_rank": 0, "node_rank": 0, "world_size": 1, "hostname": "h0"})


class StepSource:
    """Two step rows per flush, numbered on: what reaches the daemon can be counted exactly."""

    def __init__(self) -> None:
        self.steps = 0

    def build(self, now: float, *, final: bool) -> dict[str, dict[str, list[Any]]]:
        first, self.steps = self.steps, self.steps + 2
        steps = [first, first + 1]
        return {"steps": {"step": steps, "ts": [now, now], "step_ns": [20_000_000] * 2,
                          "forward_ns": [6_000_000] * 2, "backward_ns": [9_000_000] * 2,
                          "optimizer_ns": [2_000_000] * 2, "dataloader_ns": [2_000_000] * 2,
                          "h2d_ns": [100_000] * 2, "wait_ns": [900_000] * 2, "rss_bytes": [1 << 30] * 2}}


class Squatter:
    """Holds a port without the token. Each connection: it opens one to the real relay,
    hands that relay's challenge to its client, takes the hello and answers with its own
    accept, whose "proof" is the client's hello MAC (all it has). It records every
    frame the client sends after that."""

    def __init__(self, port: int, real_relay: int) -> None:
        self.real_relay = real_relay
        self.hellos: list[dict[str, Any]] = []
        self.after_accept: list[dict[str, Any]] = []
        self._server = socket.create_server(("127.0.0.1", port))
        self._lock = threading.Lock()
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @staticmethod
    def _next(sock: socket.socket, decoder: FrameDecoder) -> dict[str, Any] | None:
        while True:
            body = decoder.next_frame()
            if body is not None:
                return unpack_message(body)
            data = sock.recv(65536)
            if not data:
                return None
            decoder.append(data)

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn, socket.create_connection(("127.0.0.1", self.real_relay), timeout=10) as relay:
                challenge = self._next(relay, FrameDecoder())
                assert challenge is not None and challenge["t"] == wm.CHALLENGE
                conn.sendall(encode_frame(challenge))
                decoder = FrameDecoder()
                hello = self._next(conn, decoder)
                if hello is None:
                    return
                with self._lock:
                    self.hellos.append(hello)
                conn.sendall(encode_frame(wm.accept(0, proof=hello["mac"])))
                while (message := self._next(conn, decoder)) is not None:
                    with self._lock:
                        self.after_accept.append(message)
        except OSError:
            pass

    def close(self) -> None:
        try:
            self._server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._server.close()


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    from agent import sender as sender_mod

    monkeypatch.setattr(sender_mod, "BACKOFF_MAX_S", 0.1)
    monkeypatch.setattr(sender_mod, "BACKOFF_MIN_S", 0.02)


def test_agent_sends_nothing_to_a_squatter_on_the_relay_port_says_so_once_and_delivers_later(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "run.db"
    port = free_port()
    with DaemonProcess(db, env=base_env(TRACEML_TOKEN=TOKEN)) as daemon:
        upstream = ("127.0.0.1", daemon.port)
        real = start_relay_thread(port=0, upstream=upstream, token=TOKEN, session="auth", node=NODE,
                                  spool_dir=str(tmp_path / "spool1"))
        squatter = Squatter(port, real.port)
        source = StepSource()
        sender = Sender(source=lambda: source, hello=lambda final: HELLO, host="127.0.0.1", port=port, token=TOKEN,
                        flush_s=0.05, buffer_bytes=1 << 20, reporter=ErrorReporter())
        relay = None
        try:
            sender.start()
            wait_for(lambda: len(squatter.hellos) >= 3, 60, interval=0.05, what="three hellos to the squatter")
            assert squatter.after_accept == []  # not one batch, not even a bye
            assert sender.acked == 0 and len(sender.buffer) == sender.seq > 0  # kept for the real relay
            # The squatter goes; the node's real relay takes the port and everything arrives.
            squatter.close()
            relay = start_relay_thread(port=port, upstream=upstream, token=TOKEN, session="auth", node=NODE,
                                       spool_dir=str(tmp_path / "spool2"))
            wait_for(lambda: sender.acked > 0, 60, what="the real relay acknowledging")
            assert sender.stop(10.0)
        finally:
            sender.stop(1.0)
            squatter.close()
            for handle in (relay, real):
                if handle is not None:
                    handle.stop(timeout=10, agent_grace=0)
        assert sender.acked == sender.seq
        wait_for(lambda: count_steps(db) == source.steps, 30, what="every step stored")
        assert squatter.after_accept == []
        assert daemon.stop() == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("[traceml]")]
    assert len(lines) == 1, err
    assert "could not prove it holds TRACEML_TOKEN" in lines[0] and f"127.0.0.1:{port}" in lines[0]
    assert TOKEN not in err


def _start_relay(port: int, daemon: DaemonProcess, spool: Path, token: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "relay", "--port", str(port), "--daemon", daemon.address, "--session", "auth",
         "--spool-dir", str(spool), "--flush-timeout", "1"],
        cwd=REPO, env=base_env(TRACEML_TOKEN=token), stderr=subprocess.PIPE, text=True,
    )
    assert proc.stderr is not None
    line = proc.stderr.readline()  # printed once the agent port is bound
    assert "listening" in line, line
    return proc


async def _agent_sends(port: int, batches: int) -> None:
    agent = FakeAgent(port, TOKEN, sender="auth/a0/n0/r0/1-aa")
    assert (await agent.connect())["t"] == "accept"  # the relay itself proves the token to its agent
    assert await agent.send_batches(range(1, batches + 1), body_for("a")) == list(range(1, batches + 1))
    await agent.close()


def test_relay_does_not_forward_to_a_daemon_holding_another_token(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    daemon_token = "the-daemons-own-token-1c9e"
    with DaemonProcess(db, env=base_env(TRACEML_TOKEN=daemon_token)) as daemon:
        port = free_port()
        relay = _start_relay(port, daemon, tmp_path / "spool", TOKEN)
        try:
            asyncio.run(_agent_sends(port, 3))  # the relay holds them: it acks agents itself
            wait_for(lambda: daemon.log().count("refused") >= 2, 60, what="the daemon refusing the relay twice")
        finally:
            relay.terminate()
            _, err = relay.communicate(timeout=60)
        assert relay.returncode == 0, err
        assert daemon.stop() == 0
    lines = [line for line in err.splitlines() if line.startswith("[traceml]")]
    refusals = [line for line in lines if "refused this relay" in line]
    assert len(refusals) == 1 and "TRACEML_TOKEN" in refusals[0], err
    assert "unreachable" not in err
    assert TOKEN not in err and daemon_token not in err
    assert TOKEN not in daemon.log() and daemon_token not in daemon.log()
    assert "token" in daemon.log()  # the daemon says why it refused
    assert count_steps(db) == 0
    assert daemon_counters(db)["refused_peers"] >= 2
    assert list((tmp_path / "spool").rglob("*"))  # the held batches stay on disk for a later ingest


@pytest.mark.parametrize("proof", [None, b"\x00" * 32], ids=["no-proof", "forged-proof"])
def test_relay_sends_nothing_to_a_squatter_on_the_daemon_port(proof: bytes | None,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    @run
    async def scenario() -> None:
        squatter = FakeDaemon(token=None)
        squatter.squat, squatter.squat_proof = True, proof
        await squatter.start()
        relay = NodeRelay(port=0, upstream=("127.0.0.1", squatter.port), token=TOKEN, session="auth", node=NODE,
                          spool_dir=None, flush_interval=0.05)
        async with relay:
            agent = FakeAgent(relay.port, TOKEN)
            await agent.connect()
            assert await agent.send_batches(range(1, 4), body_for("a")) == [1, 2, 3]
            await eventually(lambda: squatter.connections >= 3)
            assert squatter.rbatches == [] and not relay.upstream.connected
            assert relay.statistics()["rbatches_sent"] == 0
            await agent.close()
        await squatter.stop()

    scenario()
    err = capsys.readouterr().err
    unverified = [line for line in err.splitlines() if "did not prove it holds TRACEML_TOKEN" in line]
    assert len(unverified) == 1 and unverified[0].startswith("[traceml] relay:"), err
    assert TOKEN not in err
