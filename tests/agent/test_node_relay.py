"""Local rank 0 hosts the node relay: started on that rank only, quiet when the port is taken,
stopped within the shutdown budget (the last test, in real subprocesses)."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from agent.config import load_config
from agent.errors import ErrorReporter
from agent.identity import current_identity
from agent.node_relay import port_in_use, start_node_relay
from tests.agent.procs import spawn
from tests.agent.test_runtime import STEPS, refusing_port


def start(env: dict[str, str], calls: list[dict[str, Any]] | None = None, error: Exception | None = None) -> Any:
    def starter() -> Any:
        def start_relay(**kwargs: Any) -> Any:
            if error is not None:
                raise error
            if calls is not None:
                calls.append(kwargs)
            return "relay"
        return start_relay

    config, problems = load_config(env)
    assert problems == []
    return start_node_relay(config, current_identity(env), starter, ErrorReporter())


def test_relay_started_on_local_rank_zero_only() -> None:
    calls: list[dict[str, Any]] = []
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "GROUP_RANK": "3", "TORCHELASTIC_RUN_ID": "j",
           "TRACEML_DAEMON": "head:4000", "TRACEML_RELAY_PORT": "4001", "TRACEML_TOKEN": "t"}
    assert start(env, calls) == "relay"
    assert len(calls) == 1
    call = calls[0]
    assert call["port"] == 4001 and call["upstream"] == ("head", 4000) and call["token"] == "t"
    assert call["session"] == "j" and call["node"]["node_rank"] == 3 and call["spool_dir"] is None
    assert start({**env, "RANK": "1", "LOCAL_RANK": "1"}, calls) is None
    assert len(calls) == 1


def test_relay_port_taken_is_silent(capsys: pytest.CaptureFixture[str]) -> None:
    taken = OSError(98, "Address already in use")
    taken.errno = 98
    assert port_in_use(taken)
    assert start({}, error=taken) is None
    assert capsys.readouterr().err == ""
    assert start({}, error=RuntimeError("kaput")) is None
    assert "[traceml] could not start the node relay" in capsys.readouterr().err


def test_exit_waits_for_other_agents_no_longer_than_the_shutdown_budget() -> None:
    """Local rank 0 hosts the node relay; a rank that stays connected must not hold
    its exit past TRACEML_SHUTDOWN_S (it used to wait a fixed 10 s grace)."""
    import time

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        relay_port = probe.getsockname()[1]
    with refusing_port() as daemon_port:
        common = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "grace",
                  "TRACEML_RELAY_PORT": str(relay_port), "TRACEML_DAEMON": f"127.0.0.1:{daemon_port}",
                  "TRACEML_SHUTDOWN_S": "1"}
        body = "import agent, sys, time\nagent.init()\n" + STEPS.format(n=5)
        leader = spawn(body + "print('stepped', flush=True)\nsys.stdin.readline()\n",
                       RANK="0", LOCAL_RANK="0", TRACEML_NO_RELAY="0", **common)
        try:
            assert leader.stdout is not None and leader.stdout.readline().strip() == "stepped"
            other = spawn(body + "print('stepped', flush=True)\ntime.sleep(60)\n", RANK="1", LOCAL_RANK="1", **common)
            try:
                assert other.stdout is not None and other.stdout.readline().strip() == "stepped"
                time.sleep(1.0)  # a few flushes: rank 1 is connected to the leader's relay
                assert leader.stdin is not None
                started = time.monotonic()
                leader.stdin.write("exit\n")
                leader.stdin.flush()
                assert leader.wait(30) == 0
                # The 1 s budget plus interpreter teardown; the old fixed grace alone was 10 s.
                assert time.monotonic() - started < 6.0
            finally:
                other.kill()
                other.wait()
        finally:
            leader.kill()
            leader.wait()
