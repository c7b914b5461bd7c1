"""The agent-facing thread API and the standalone ``traceml-relay`` process."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from relay_helpers import FakeAgent, FakeDaemon, body_for

from relay.node import start_relay_thread

REPO = Path(__file__).resolve().parents[2]
TOKEN = "tok"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DaemonThread:
    """A FakeDaemon on its own loop thread, for tests whose relay runs on a thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.daemon = FakeDaemon(TOKEN)
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.daemon.start(), self.loop).result(10)

    def items(self) -> list[tuple[str, int, bytes]]:
        return asyncio.run_coroutine_threadsafe(self._items(), self.loop).result(10)

    async def _items(self) -> list[tuple[str, int, bytes]]:
        return self.daemon.items()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.daemon.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


async def _agent_sends(port: int, n: int) -> None:
    agent = FakeAgent(port, TOKEN)
    assert (await agent.connect())["t"] == "accept"
    assert await agent.send_batches(range(1, n + 1), body_for("a")) == list(range(1, n + 1))
    await agent.close()


def test_start_relay_thread_binds_forwards_and_stop_flushes(tmp_path: Path) -> None:
    daemon = DaemonThread()
    try:
        handle = start_relay_thread(
            port=0, upstream=("127.0.0.1", daemon.daemon.port), token=TOKEN, session="s", node={"node_rank": 1, "hostname": "h"}, spool_dir=str(tmp_path)
        )
        assert handle.port > 0
        asyncio.run(_agent_sends(handle.port, 3))
        handle.stop(timeout=5)  # must flush before returning
        assert [seq for _, seq, _ in daemon.items()] == [1, 2, 3]
        assert not handle.alive
        assert handle.statistics()["received_batches"] == 3
    finally:
        daemon.close()


def test_second_relay_on_same_port_raises_oserror(tmp_path: Path) -> None:
    first = start_relay_thread(port=0, upstream=("127.0.0.1", _free_port()), token=None, session="s", node={}, spool_dir=str(tmp_path))
    try:
        with pytest.raises(OSError):
            start_relay_thread(port=first.port, upstream=("127.0.0.1", 1), token=None, session="s", node={}, spool_dir=str(tmp_path))
    finally:
        first.stop(timeout=0.2)


def _relay_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "relay", *args]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_standalone_relay_forwards_and_exits_zero_on_sigterm(tmp_path: Path) -> None:
    daemon = DaemonThread()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    port = _free_port()
    proc = subprocess.Popen(
        _relay_cmd("--port", str(port), "--daemon", f"127.0.0.1:{daemon.daemon.port}", "--token-file", str(token_file), "--node-rank", "2", "--session", "sx", "--spool-dir", str(tmp_path / "spool")),
        cwd=REPO,
        env=_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # printed once the port is bound
        assert "listening" in line, line
        asyncio.run(_agent_sends(port, 4))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert [seq for _, seq, _ in daemon.items()] == [1, 2, 3, 4]
        assert daemon.daemon.hellos[0]["sender"].startswith("relay/sx/n2/")
    finally:
        if proc.poll() is None:
            proc.kill()
        daemon.close()


@pytest.mark.parametrize(
    "args,needle",
    [(["--daemon", "nohost"], "host:port"), (["--port", "http"], "port"), (["--token-file", "/nonexistent/t"], "token-file"), (["--node-rank", "-1"], "node-rank")],
)
def test_standalone_bad_flags_give_clear_errors(args: list[str], needle: str) -> None:
    result = subprocess.run(_relay_cmd(*args), cwd=REPO, env=_env(), capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert needle in result.stderr and "Traceback" not in result.stderr


def test_relay_never_imports_torch() -> None:
    code = "import sys, relay, relay.__main__; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), check=True, timeout=60)
