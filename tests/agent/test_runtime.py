"""The agent's lifecycle through its public API, in real subprocesses.

Each script imports the real ``agent`` package (and the real tracer), talks
to a real TCP relay stand-in, and exits the way training scripts do.
"""

from __future__ import annotations

import contextlib
import re
import signal
import socket
from typing import Any

import pytest

from agent.config import Config, load_config
from tests.agent.fake_relay import FakeRelay
from tests.agent.procs import run, spawn, traceml_lines
from traceml_wire.tables import decode_body

STEPS = """
import torch
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range({n}):
    with agent.trace_step(model):
        loss = model(torch.randn(8, 4)).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    agent.log(loss=loss)
"""


@contextlib.contextmanager
def refusing_port() -> Any:
    """A port that refuses connections: bound (so no one else takes it), not listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def tables_of(relay: FakeRelay) -> dict[str, list[dict[str, Any]]]:
    """Every row the relay received, per table, as dicts."""
    out: dict[str, list[dict[str, Any]]] = {}
    for _, _, body in relay.batches:
        for name, cols in decode_body(body).items():
            keys = list(cols)
            out.setdefault(name, []).extend(dict(zip(keys, vals, strict=True)) for vals in zip(*cols.values(), strict=True))
    return out


# ------------------------------------------------------------ subprocesses


def test_unreachable_relay_costs_one_warning_and_nothing_else() -> None:
    code = "import agent\nagent.init()\n" + STEPS.format(n=20) + """
with agent.span("eval", epoch=1):
    pass
agent.instant("checkpoint")
print("done")
"""
    with refusing_port() as port:
        done = run(code, TRACEML_RELAY_PORT=str(port))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "done"
    lines = traceml_lines(done.stderr)
    assert len(lines) == 1 and "unreachable" in lines[0], done.stderr
    assert "Traceback" not in done.stderr


def nvml_loads() -> bool:
    from agent.samplers import Nvml

    nvml = Nvml()
    ok = nvml.ok
    nvml.close()
    return ok


def test_batches_reach_the_relay_with_identity_and_final_status(make_relay: Any) -> None:
    relay: FakeRelay = make_relay(token="tok")
    code = "import agent\nagent.init()\n" + STEPS.format(n=5) + "agent.shutdown()\nprint('ok')\n"
    done = run(code, TRACEML_RELAY_PORT=str(relay.port), TRACEML_TOKEN="tok", TRACEML_SESSION="unit")
    assert done.returncode == 0, done.stderr
    assert traceml_lines(done.stderr) == []
    hello = relay.hellos[0]
    assert hello["role"] == "agent" and hello["session"] == "unit"
    assert re.fullmatch(r"unit/a0/n0/r0/\d+-[0-9a-f]+", hello["sender"])
    assert hello["identity"]["global_rank"] == 0 and hello["identity"]["world_size"] == 1
    seqs = relay.seqs()
    assert seqs == list(range(1, len(seqs) + 1))
    rows = tables_of(relay)
    assert len(rows["steps"]) == 5
    assert rows["status"][-1]["finished"] == 1 and rows["status"][-1]["steps_done"] == 5
    assert rows["process"] and rows["process"][-1]["rss_bytes"] > 0
    assert rows["system"]  # single process = local rank 0 samples the host
    assert {r["source"] for r in rows["drops"]} >= {"recorder_rows", "sender_batches"}
    # GPU rows where NVML loads (a GPU machine); elsewhere none rather than zeros.
    assert ("gpu" in rows) == nvml_loads()
    assert relay.byes == 1


def test_connecting_happens_on_the_sender_thread(fake_relay: FakeRelay) -> None:
    fake_relay.mode = "silent"  # accepts TCP but never answers the handshake
    code = """
import socket, threading, sys
threads = []
real = socket.create_connection
def spy(*a, **k):
    threads.append(threading.current_thread().name)
    return real(*a, **k)
socket.create_connection = spy
import agent
agent.init()
""" + STEPS.format(n=10) + """
print("steps-done", flush=True)
sys.stdin.readline()  # the test lets us go once the relay saw the connection
agent.shutdown()
print(sorted(set(threads)))
"""
    proc = spawn(code, TRACEML_RELAY_PORT=str(fake_relay.port))
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "steps-done"
        assert fake_relay.wait_for(lambda: fake_relay.connections >= 1)
        out, err = proc.communicate("go\n", timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    assert proc.returncode == 0, err
    assert out.strip().splitlines()[-1] == "['traceml-sender']"


def test_disable_makes_every_call_a_noop(fake_relay: FakeRelay) -> None:
    code = """
import contextlib, sys, threading
import agent
agent.init()
cm = agent.trace_step(object())
assert isinstance(cm, contextlib.nullcontext), cm
with cm:
    pass
with agent.span("x", a=1):
    pass
agent.log(loss=1.0)
agent.instant("y")
agent.shutdown()
print(sorted(t.name for t in threading.enumerate()), "torch" in sys.modules)
"""
    done = run(code, TRACEML_DISABLE="1", TRACEML_RELAY_PORT=str(fake_relay.port))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['MainThread'] False"
    assert done.stderr == "" and fake_relay.connections == 0


@pytest.mark.parametrize(
    ("ending", "code_tail", "expected"),
    [
        ("clean", "", 0),
        ("exception", "raise ValueError('boom')", 1),
        ("sys.exit", "import sys; sys.exit(3)", 3),
    ],
)
def test_exit_status_is_never_changed(fake_relay: FakeRelay, ending: str, code_tail: str, expected: int) -> None:
    fake_relay.mode = "silent"  # the worst relay for a bounded shutdown: it never answers
    code = "import agent\nagent.init()\n" + STEPS.format(n=3) + code_tail + "\n"
    done = run(code, TRACEML_RELAY_PORT=str(fake_relay.port))
    assert done.returncode == expected, done.stderr
    if ending == "exception":
        assert "ValueError: boom" in done.stderr
    assert all("Traceback" not in line for line in traceml_lines(done.stderr))
    assert done.stderr.count("Traceback") == (1 if ending == "exception" else 0)


def test_sigterm_keeps_its_exit_status(fake_relay: FakeRelay) -> None:
    code = "import agent, sys, time\nagent.init()\n" + STEPS.format(n=3) + """
print("ready", flush=True)
time.sleep(120)
"""
    proc = spawn(code, TRACEML_RELAY_PORT=str(fake_relay.port))
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    assert proc.returncode == -signal.SIGTERM, err


def test_fork_child_is_reset_until_it_calls_init(fake_relay: FakeRelay) -> None:
    code = "import os, threading\nimport agent\nfrom agent import runtime\nagent.init()\n" + STEPS.format(n=2) + """
def senders():
    return [t for t in threading.enumerate() if t.name == "traceml-sender"]
pid = os.fork()
if pid == 0:
    ok = runtime.current is None and not senders()
    with agent.trace_step(model):
        pass
    agent.log(x=1.0)
    ok = ok and runtime.current is None and not senders()
    agent.init()
    ok = ok and runtime.current is not None and len(senders()) == 1
    agent.shutdown()
    os._exit(0 if ok else 17)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
with agent.trace_step(model):
    pass
agent.shutdown()
print("parent", os.getpid())
"""
    done = run(code, TRACEML_RELAY_PORT=str(fake_relay.port))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split()
    assert lines[:2] == ["child", "0"], done.stdout
    parent_pid = int(lines[3])
    pids = {h["identity"]["pid"] for h in fake_relay.hellos}
    assert parent_pid in pids and len(pids) == 2  # the child connected only after its own init()


# ------------------------------------------------------------ configuration


def test_config_parsing_never_raises() -> None:
    config, problems = load_config(
        {"TRACEML_RELAY_PORT": "nope", "TRACEML_FLUSH_S": "-1", "TRACEML_DAEMON": "head:29999",
         "TRACEML_DEEP_DIVE": "1", "TRACEML_DEEP_DIVE_EVERY": "7"},
        {"deep_dive_every": 9, "bogus": 1},
    )
    assert config.relay_port == Config().relay_port and config.flush_s == Config().flush_s
    assert config.daemon == ("head", 29999) and config.deep_dive and config.deep_dive_every == 9
    assert len(problems) == 3 and any("bogus" in p for p in problems)
    assert "token" not in repr(load_config({"TRACEML_TOKEN": "secret"})[0]).split("token=")[-1:][0][:0] + "x"
    assert "secret" not in repr(load_config({"TRACEML_TOKEN": "secret"})[0])


def test_shutdown_budget_from_the_environment() -> None:
    assert load_config({"TRACEML_SHUTDOWN_S": "30"})[0].shutdown_timeout_s == 30.0
    config, problems = load_config({"TRACEML_SHUTDOWN_S": "soon"})
    assert config.shutdown_timeout_s == Config().shutdown_timeout_s
    assert len(problems) == 1 and "TRACEML_SHUTDOWN_S" in problems[0]
