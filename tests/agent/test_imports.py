"""``import agent`` stays light: no UI/storage stack, torch only when tracing starts."""

from __future__ import annotations

import socket

from tests.agent.procs import run

CHECK = "import sys; print(sorted(m for m in ('textual', 'aiosqlite', 'torch') if m in sys.modules))"


def test_import_agent_pulls_neither_textual_nor_aiosqlite_nor_torch() -> None:
    done = run("import agent\n" + CHECK)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_running_agent_with_its_relay_never_imports_textual_or_aiosqlite() -> None:
    with socket.socket() as daemon_port, socket.socket() as relay_port:
        daemon_port.bind(("127.0.0.1", 0))
        relay_port.bind(("127.0.0.1", 0))
        relay_port_no = relay_port.getsockname()[1]
        relay_port.close()  # the agent's in-process relay binds it
        code = "import agent\nagent.init()\nwith agent.trace_step():\n    pass\nagent.shutdown()\n" + CHECK
        done = run(
            code,
            TRACEML_NO_RELAY="0",
            TRACEML_RELAY_PORT=str(relay_port_no),
            TRACEML_DAEMON=f"127.0.0.1:{daemon_port.getsockname()[1]}",
        )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['torch']"  # the tracer needs torch; nothing of the daemon's stack


def test_init_builds_no_tracer_and_the_first_step_does() -> None:
    # init() only reads config and identity and starts the sender thread: the capture
    # machinery (agent.tracer, its patches, torch) comes with the first trace_step.
    code = (
        "import sys, time\nimport agent\nagent.init()\ntime.sleep(0.3)\n"
        "print(sorted(m for m in ('torch', 'agent.tracer') if m in sys.modules))\n"
        "with agent.trace_step():\n    pass\n"
        "print(sorted(m for m in ('torch', 'agent.tracer') if m in sys.modules))\n"
        "agent.shutdown()\n"
    )
    done = run(code, TRACEML_DAEMON="127.0.0.1:9")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[]", "['agent.tracer', 'torch']"]


def test_with_torch_imported_the_sender_thread_installs_the_tracer_before_any_step() -> None:
    # So the first DataLoader fetch (before the first trace_step) is already timed.
    code = (
        "import time\nimport torch\nfrom torch.utils.data.dataloader import _BaseDataLoaderIter\n"
        "orig = _BaseDataLoaderIter.__next__\nimport agent\nagent.init()\n"
        "deadline = time.monotonic() + 20\n"
        "while _BaseDataLoaderIter.__next__ is orig and time.monotonic() < deadline:\n    time.sleep(0.01)\n"
        "print(_BaseDataLoaderIter.__next__ is not orig)\nagent.shutdown()\n"
        "print(_BaseDataLoaderIter.__next__ is orig)\n"
    )
    done = run(code, TRACEML_DAEMON="127.0.0.1:9")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"]
