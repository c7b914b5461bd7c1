"""Relays reaching a real TLS daemon: the standalone ``traceml-relay`` with the
CA from TRACEML_TLS_CA or --tls-ca, the relay thread an agent starts on local
rank 0, and a relay holding the wrong CA."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

from relay_helpers import FakeAgent

from relay.node import start_relay_thread
from tests.support.procs import REPO, DaemonProcess, base_env, free_port, wait_for
from tests.traceml_daemon.net.test_tls_and_limits import Certs, make_certs, needs_openssl, tls_args
from tests.traceml_daemon.wire_client import agent_sender, count_steps, steps_body

TOKEN = "tls-test-token"
SENDER = agent_sender("s1", 0)

pytestmark = needs_openssl


async def _agent_sends_steps(port: int, batches: int, steps_per_batch: int = 5) -> None:
    """One agent: hello, then numbered batches of real step tables; waits for the relay's acks."""
    agent = FakeAgent(port, TOKEN, sender=SENDER)
    assert (await agent.connect())["t"] == "accept"
    acked = await agent.send_batches(range(1, batches + 1),
                                     lambda seq: steps_body((seq - 1) * steps_per_batch, steps_per_batch))
    assert acked == list(range(1, batches + 1))
    await agent.close()


def _start_relay(port: int, daemon: DaemonProcess, spool: Path, *args: str, **env: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "relay", "--port", str(port), "--daemon", daemon.address, "--session", "s1",
         "--spool-dir", str(spool), *args],
        cwd=REPO, env=base_env(TRACEML_TOKEN=TOKEN, **env), stderr=subprocess.PIPE, text=True,
    )
    assert proc.stderr is not None
    line = proc.stderr.readline()  # printed once the agent port is bound
    assert "listening" in line, line
    return proc


def _stop(proc: subprocess.Popen[str]) -> str:
    """SIGTERM the relay; return the rest of its stderr."""
    if proc.poll() is None:
        proc.terminate()
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err


def _tls_daemon(tmp_path: Path, certs: Certs) -> DaemonProcess:
    return DaemonProcess(tmp_path / "run.db", args=tls_args(certs), env=base_env(TRACEML_TOKEN=TOKEN))


def test_standalone_relay_with_the_ca_from_the_environment_delivers(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs")
    with _tls_daemon(tmp_path, certs) as daemon:
        port = free_port()
        relay = _start_relay(port, daemon, tmp_path / "spool", TRACEML_TLS_CA=str(certs.ca))
        try:
            asyncio.run(_agent_sends_steps(port, 3))
            wait_for(lambda: count_steps(daemon.db) == 15, 30, what="15 steps stored through the TLS relay")
        finally:
            err = _stop(relay)
        assert relay.returncode == 0, err
        assert "unreachable" not in err
        assert daemon.stop() == 0
    assert "TLS handshake failed" not in daemon.log()


def test_relay_with_the_wrong_ca_fails_to_connect_and_says_why(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs")
    with _tls_daemon(tmp_path, certs) as daemon:
        port = free_port()
        relay = _start_relay(port, daemon, tmp_path / "spool", "--tls-ca", str(certs.other_ca), "--flush-timeout", "1")
        try:
            asyncio.run(_agent_sends_steps(port, 2))  # the relay holds them: it acks agents itself
            wait_for(lambda: "TLS handshake failed" in daemon.log(), 30, what="the daemon logging the failed handshake")
        finally:
            err = _stop(relay)
        assert "CERTIFICATE_VERIFY_FAILED" in err, err
        assert "TRACEML_TLS_CA" in err  # names the setting to fix
        assert count_steps(daemon.db) == 0
        # The daemon itself is unaffected: a relay with the right CA gets through.
        good = _start_relay(free_port(), daemon, tmp_path / "spool2", "--tls-ca", str(certs.ca))
        try:
            good_port = int(good.args[good.args.index("--port") + 1])
            asyncio.run(_agent_sends_steps(good_port, 1))
            wait_for(lambda: count_steps(daemon.db) == 5, 30, what="steps stored through the right CA")
        finally:
            _stop(good)
        assert daemon.stop() == 0


def test_relay_thread_takes_the_ca(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs")
    with _tls_daemon(tmp_path, certs) as daemon:
        handle = start_relay_thread(port=0, upstream=("127.0.0.1", daemon.port), token=TOKEN, session="s1",
                                    node={"node_rank": 0, "hostname": "h0"}, spool_dir=str(tmp_path / "spool"),
                                    tls_ca=str(certs.ca))
        try:
            asyncio.run(_agent_sends_steps(handle.port, 2))
        finally:
            handle.stop(timeout=10)  # flushes what it holds before returning
        assert count_steps(daemon.db) == 10
        assert daemon.stop() == 0


def test_agent_on_local_rank_zero_passes_traceml_tls_ca_to_its_relay(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs")
    code = textwrap.dedent("""
        import agent, torch
        agent.init()
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(6):
            with agent.trace_step(model):
                model(torch.randn(8, 4)).sum().backward()
                opt.step()
        agent.shutdown()
    """)
    with _tls_daemon(tmp_path, certs) as daemon:
        env = base_env(TRACEML_DAEMON=daemon.address, TRACEML_TOKEN=TOKEN, TRACEML_TLS_CA=str(certs.ca),
                       TRACEML_RELAY_PORT=str(free_port()), TRACEML_SESSION="tls", TRACEML_FLUSH_S="0.1",
                       TRACEML_SPOOL_DIR=str(tmp_path / "spool"))
        done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=180)
        assert done.returncode == 0, done.stderr
        assert "[traceml]" not in done.stderr, done.stderr
        wait_for(lambda: count_steps(daemon.db) == 6, 30, what="6 steps stored through the agent's TLS relay")
        assert daemon.stop() == 0
    assert "TLS handshake failed" not in daemon.log()
