"""Sessions still pending are visible live, with their age, through the real relay and daemon,
and finalizing their task later turns them into finished records (phases left open closed
with no end)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.procs import DaemonProcess, base_env, cli, free_port, wait_for

pytestmark = pytest.mark.slow

SCRIPT = """
import asyncio, sys
import agent

agent.init()
gate = asyncio.Event

@agent.session_context()
async def collect(release):
    async with agent.trace_session_phase("generate"):
        await release.wait()

async def main():
    release = gate()
    task = agent.set_task_id(7)
    runs = [asyncio.create_task(collect(release)) for _ in range(3)]
    await asyncio.sleep(0.05)
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    agent.trace_session_event("mark_finalized", task_id=task, status="failed", reason="engine restarted")
    release.set()
    await asyncio.gather(*runs)

asyncio.run(main())
agent.shutdown()
"""


def _sessions(db: Path) -> dict[str, Any] | None:
    done = cli("sessions", "--db", str(db), "--json")
    return json.loads(done.stdout) if done.returncode == 0 else None


def test_pending_sessions_are_seen_live_then_finalized_by_task(tmp_path: Path) -> None:
    db = tmp_path / "live.db"
    with DaemonProcess(db).start() as daemon:
        env = base_env(TRACEML_DAEMON=daemon.address, TRACEML_RELAY_PORT=str(free_port()), TRACEML_FLUSH_S="0.2")
        proc = subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            live = wait_for(lambda: (s := _sessions(db)) and s["pending"] == 3 and s, timeout=60,
                            what="three pending sessions in the database")
            assert [p["task_id"] for p in live["oldest_pending"]] == [7, 7, 7]
            assert all(p["age_s"] is not None and p["age_s"] >= 0 for p in live["oldest_pending"])
            out, err = proc.communicate("go\n", timeout=60)
            assert proc.returncode == 0, err
        finally:
            if proc.poll() is None:
                proc.kill()
    out_file = tmp_path / "s.jsonl"
    assert cli("sessions", "--db", str(db), "--jsonl", str(out_file)).returncode == 0
    recs = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [(r["task_id"], r["status"], r["reason"], r["open_phases"]) for r in recs] == [
        (7, "failed", "engine restarted", 1)] * 3
    assert all(r["phases"]["generate"][0]["end_ts"] is None for r in recs)
