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
