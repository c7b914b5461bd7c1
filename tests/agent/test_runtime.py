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

from agent import runtime as runtime_mod
from agent.config import Config, load_config
from agent.errors import ErrorReporter
from agent.identity import DistState, resolve_identity
from agent.runtime import NULL_CONTEXT, Guarded, Runtime
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


# ------------------------------------------------------------ in-process units


class StandInTracer:
    """Minimal stand-in for agent.tracer.Tracer (the fixed interface only)."""

    def __init__(self, recorder: Any, **kwargs: Any) -> None:
        self.recorder = recorder
        self.kwargs = kwargs
        self.steps = 0

    def install(self) -> None: ...
    def uninstall(self) -> None: ...

    def trace_step(self, model: Any = None) -> Any:
        self.steps += 1
        return NULL_CONTEXT

    def status(self) -> dict[str, Any]:
        return {"phase": "idle", "phase_since": 0.0, "step": self.steps, "steps_done": self.steps}

    def poll(self) -> None: ...

    def parallelism(self) -> str:
        return "single"


def make_runtime(env: dict[str, str], relay_calls: list[dict[str, Any]] | None = None,
                 relay_error: Exception | None = None, **overrides: Any) -> Runtime:
    def starter() -> Any:
        def start(**kwargs: Any) -> Any:
            if relay_error is not None:
                raise relay_error
            if relay_calls is not None:
                relay_calls.append(kwargs)
            return None
        return start

    config, problems = load_config(env, overrides)
    assert problems == []
    return Runtime(config, env=env, tracer_factory=lambda: StandInTracer, relay_starter=starter,
                   reporter_=ErrorReporter())


def test_first_hello_waits_for_the_first_step_in_a_plain_process(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"MASTER_ADDR": "h", "MASTER_PORT": "1"}
    rt = make_runtime(env)
    assert rt._hello(False) is None  # torch.distributed may still be coming up
    monkeypatch.setattr(runtime_mod, "current_identity", lambda e: resolve_identity(e, DistState(rank=1, world_size=2)))
    rt.trace_step(None)
    hello = rt._hello(False)
    assert hello is not None and hello.identity["global_rank"] == 1 and "/r1/" in hello.sender
    assert hello.identity["parallelism"] == "single"


def test_torchrun_identity_is_final_at_init() -> None:
    rt = make_runtime({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "j"})
    hello = rt._hello(False)
    assert hello is not None and hello.sender.startswith("j/a0/n0/r1/")


def test_relay_started_on_local_rank_zero_only() -> None:
    calls: list[dict[str, Any]] = []
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "GROUP_RANK": "3", "TORCHELASTIC_RUN_ID": "j",
           "TRACEML_DAEMON": "head:4000", "TRACEML_RELAY_PORT": "4001", "TRACEML_TOKEN": "t"}
    make_runtime(env, calls)._start_relay()
    assert len(calls) == 1
    call = calls[0]
    assert call["port"] == 4001 and call["upstream"] == ("head", 4000) and call["token"] == "t"
    assert call["session"] == "j" and call["node"]["node_rank"] == 3 and call["spool_dir"] is None
    make_runtime({**env, "RANK": "1", "LOCAL_RANK": "1"}, calls)._start_relay()
    assert len(calls) == 1


def test_relay_port_taken_is_silent(capsys: pytest.CaptureFixture[str]) -> None:
    taken = OSError(98, "Address already in use")
    taken.errno = 98
    rt = make_runtime({}, relay_error=taken)
    rt._start_relay()
    assert capsys.readouterr().err == ""
    rt = make_runtime({}, relay_error=RuntimeError("kaput"))
    rt._start_relay()
    assert "[traceml] could not start the node relay" in capsys.readouterr().err


def test_guarded_swallows_tracer_errors_but_not_user_errors() -> None:
    class Broken:
        def __enter__(self) -> None:
            raise RuntimeError("tracer bug")

        def __exit__(self, *exc: Any) -> bool:
            raise RuntimeError("tracer bug on exit")

    reporter = ErrorReporter()
    with Guarded(Broken(), reporter, "step"):
        pass
    with pytest.raises(KeyError), Guarded(Broken(), reporter, "step"):
        raise KeyError("user")
    assert reporter.counts["step"] >= 1


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
