"""Identity end to end: the real daemon (and the real relay) take a rank's identity
from its hello, whatever its sender id looks like, and a hostile identity value
never reaches SQLite nor stops the daemon from serving the next peer."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support.procs import REPO, DaemonProcess, base_env, free_port, wait_for
from tests.traceml_daemon.wire_client import WireClient, count_steps, steps_body
from traceml_wire import messages

IDENT: dict[str, Any] = {
    "session": "job", "attempt": 0, "global_rank": 0, "local_rank": 0, "node_rank": 1, "world_size": 2,
    "local_world_size": 1, "nnodes": 2, "hostname": "gpu-a", "pid": 4242, "parallelism": "ddp", "device": "cpu",
}  # fmt: skip
COLUMNS = tuple(IDENT)


def ranks(db: Path) -> dict[str, dict[str, Any]]:
    """Each sender's stored identity."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = conn.execute(f"SELECT sender, {', '.join(COLUMNS)} FROM ranks").fetchall()
    finally:
        conn.close()
    return {row[0]: dict(zip(COLUMNS, row[1:], strict=True)) for row in rows}


def test_a_pid_of_2_63_is_dropped_and_the_daemon_serves_the_next_peer(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    hostile = "job/a0/n1/r0/4242-aa"
    foreign, unknown = "trainer-1", "job/a9/n9/r9/1-zz"  # a shape nobody parses; one with no identity sent
    with DaemonProcess(db) as daemon:
        # An agent connecting directly, its pid one past SQLite's INTEGER range.
        with WireClient(daemon.port) as agent:
            reply = agent.handshake(hostile, role=messages.ROLE_AGENT, session="job", identity={**IDENT, "pid": 2**63})
            assert reply is not None and reply["t"] == messages.ACCEPT, reply
            agent.send(messages.batch(1, steps_body(0, 4)))
            assert agent.recv() == {"t": messages.ACK, "seq": 1}
        assert daemon.proc is not None and daemon.proc.poll() is None, daemon.log()
        # The next peer, a relay: its items keep their identity from the peers map, or get none.
        with WireClient(daemon.port) as relay:
            reply = relay.handshake("relay/job/n1/9-r", session="job", identity={"node_rank": 1, "hostname": "gpu-a"})
            assert reply is not None and reply["t"] == messages.ACCEPT, reply
            peers = {foreign: {**IDENT, "global_rank": 1, "pid": 77, "world_size": 2**64 - 1}}
            items = [[foreign, 1, steps_body(0, 3)], [unknown, 1, steps_body(0, 2)]]
            relay.rbatch(1, items, peers, node={"node_rank": 1, "hostname": "gpu-a"})
            assert relay.recv() == {"t": messages.ACK, "seq": 1}
        assert count_steps(db) == 9
        assert daemon.stop() == 0, daemon.log()
    stored = ranks(db)
    assert stored[hostile] == {**IDENT, "pid": None}
    assert stored[foreign] == {**IDENT, "global_rank": 1, "pid": 77, "world_size": None}
    # Stored with NULL identity; the node from its relay's node map, the run from the relay's hello.
    assert stored[unknown] == {**dict.fromkeys(COLUMNS), "session": "job", "attempt": 0, "node_rank": 1,
                               "hostname": "gpu-a"}
    log = daemon.log()
    assert f"identity of {hostile}: dropped pid" in log and f"identity of {foreign}: dropped world_size" in log
    assert "Traceback" not in log


def _start_relay(port: int, daemon: DaemonProcess, spool: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "relay", "--port", str(port), "--daemon", daemon.address, "--session", "job",
         "--node-rank", "1", "--spool-dir", str(spool)],
        cwd=REPO, env=base_env(), stderr=subprocess.PIPE, text=True,
    )
    assert proc.stderr is not None
    line = proc.stderr.readline()  # printed once the agent port is bound
    assert "listening" in line, line
    return proc


def test_through_the_real_relay_identity_is_the_hellos_and_run_id_still_reads(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    lying = "job/a4/n6/r8/1-aa"  # the old shape, stating attempt 4, node 6, rank 8: none of it true
    foreign = "worker-b"
    older = {k: v for k, v in IDENT.items() if k != "session"} | {"run_id": "job"}  # an agent before v6
    with DaemonProcess(db) as daemon:
        port = free_port()
        relay = _start_relay(port, daemon, tmp_path / "spool")
        try:
            with WireClient(port) as a, WireClient(port) as b:
                for client, sender, identity in (
                    (a, lying, older),
                    (b, foreign, {**IDENT, "global_rank": 1, "local_rank": 0, "pid": 2**63}),
                ):
                    reply = client.handshake(sender, role=messages.ROLE_AGENT, session="job", identity=identity)
                    assert reply is not None and reply["t"] == messages.ACCEPT, reply
                    client.send(messages.batch(1, steps_body(0, 5)))
                    assert client.recv() == {"t": messages.ACK, "seq": 1}
                    client.send(messages.bye())
            wait_for(lambda: count_steps(db) == 10, 30, what="10 steps stored through the relay")
        finally:
            relay.terminate()
            _, err = relay.communicate(timeout=30)
        assert relay.returncode == 0, err
        assert daemon.stop() == 0, daemon.log()
    stored = ranks(db)
    assert stored[lying] == IDENT
    assert stored[foreign] == {**IDENT, "global_rank": 1, "pid": None}
