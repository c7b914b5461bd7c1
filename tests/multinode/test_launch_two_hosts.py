"""``traceml-daemon launch`` across two simulated hosts: one command per node.

Node 0 (host A's namespace) starts the daemon bound for the network with the
token and hosts torchrun's rendezvous; node 1 (host B's namespace) only names
node 0 with --master-addr. Everything is real: the daemon, both torchruns,
the relays over the veth link.
"""

from __future__ import annotations

import re
import signal
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import pytest

from tests.support.netns import Host, netns_unavailable_reason, two_hosts
from tests.support.procs import EXAMPLES, base_env, free_port, wait_for

REASON = netns_unavailable_reason()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(REASON is not None, reason=str(REASON))]

TOKEN = "launch-two-hosts-secret"
STEPS = 12
DAEMON_PORT = 29765  # launch's default across nodes: each namespace has its own port space
WAITING = "waiting for node(s) 1 to deliver their final batches"

# A TCP forwarder that starts listening only once its gate file exists: it stands
# between node 1's relay and node 0's daemon to hold node 1's batches back.
GATE = """\
import os, socket, sys, threading, time
listen_port, target_port, gate = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
while not os.path.exists(gate):
    time.sleep(0.05)
server = socket.create_server(("0.0.0.0", listen_port))

def pipe(src, dst):
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    for s in (src, dst):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

while True:
    client, _ = server.accept()
    try:
        upstream = socket.create_connection(("127.0.0.1", target_port))
    except OSError:  # the daemon is gone: the relay just retries
        client.close()
        continue
    for a, b in ((client, upstream), (upstream, client)):
        threading.Thread(target=pipe, args=(a, b), daemon=True).start()
"""


@pytest.fixture
def hosts() -> Iterator[tuple[Host, Host]]:
    with two_hosts() as pair:
        yield pair


@dataclass
class Launch:
    """One node's ``traceml-daemon launch``, its output read as it comes."""

    proc: subprocess.Popen[str]
    out: list[str] = field(default_factory=list)
    err: list[str] = field(default_factory=list)
    waiting: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._pumps = [threading.Thread(target=self._pump, args=(stream, lines), daemon=True)
                       for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for pump in self._pumps:
            pump.start()

    def _pump(self, stream: IO[str], lines: list[str]) -> None:
        for line in stream:
            lines.append(line)
            if WAITING in line:
                self.waiting.set()

    def finish(self, timeout: float = 300.0) -> int:
        try:
            code = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        for pump in self._pumps:
            pump.join(30)
        return code

    @property
    def text(self) -> str:
        return "".join(self.out) + "".join(self.err)


def _launch(host: Host, node_rank: int, master: Host, token_file: Path, cwd: Path, extra: list[str]) -> Launch:
    cmd = host.exec_prefix() + [
        sys.executable, "-m", "traceml_daemon", "launch", "--nnodes", "2", "--node-rank", str(node_rank),
        "--master-addr", master.address, "--nproc-per-node", "2", "--token-file", str(token_file), *extra,
        "--", str(EXAMPLES / "train.py"), "--steps", str(STEPS)]
    # Both namespaces share one hostname, so gloo is told which interface is this host's.
    env = base_env(GLOO_SOCKET_IFNAME=host.ifname)
    return Launch(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))


def _setup(tmp_path: Path) -> tuple[Path, Path, Path]:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    node0.mkdir()
    node1.mkdir()
    return token_file, node0, node1


def _assert_whole_job_stored(db: Path, summary_out: str) -> None:
    """4 ranks on 2 nodes, every step of each, and the printed summary says so."""
    with sqlite3.connect(db) as conn:
        ranks = conn.execute("SELECT global_rank, local_rank, node_rank FROM ranks ORDER BY global_rank").fetchall()
        steps = dict(conn.execute("SELECT r.global_rank, COUNT(DISTINCT s.step) FROM steps s "
                                  "JOIN ranks r USING (rank_id) GROUP BY r.global_rank").fetchall())
        finished = conn.execute("SELECT COUNT(*) FROM status WHERE finished = 1").fetchone()[0]
    assert ranks == [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]
    assert steps == {0: STEPS, 1: STEPS, 2: STEPS, 3: STEPS}
    assert finished == 4
    assert "topology: 2 node(s) x world size 4" in summary_out, summary_out
    table = summary_out.split("Ranks", 1)[1].split("Nodes", 1)[0]
    rows = [line.split() for line in table.splitlines() if re.match(r"^\s+\d+\s+\d+\s", line)]
    assert [(r[0], r[1], r[4]) for r in rows] == [  # rank, node, steps
        ("0", "0", str(STEPS)), ("1", "0", str(STEPS)), ("2", "1", str(STEPS)), ("3", "1", str(STEPS))]


def test_two_launch_commands_run_one_job_into_node_0s_daemon(hosts: tuple[Host, Host], tmp_path: Path) -> None:
    token_file, dir0, dir1 = _setup(tmp_path)
    db = dir0 / "run.db"
    # Node 1 first: its ranks and relay must cope with node 0 (rendezvous and daemon) not being up yet.
    node1 = _launch(hosts[1], 1, hosts[0], token_file, dir1, [])
    node0 = _launch(hosts[0], 0, hosts[0], token_file, dir0, ["--db", str(db)])
    assert node0.finish() == 0, node0.text
    assert node1.finish() == 0, node1.text
    err0, err1 = "".join(node0.err), "".join(node1.err)
    address = f"{hosts[0].address}:{DAEMON_PORT}"
    assert f"daemon on 0.0.0.0:{DAEMON_PORT} (the other nodes send to {address})" in err0, err0
    assert f"sending to the daemon at {address}" in err1, err1
    assert TOKEN not in node0.text + node1.text

    _assert_whole_job_stored(db, "".join(node0.out))
    # Node 0 printed the summary of the whole job and left it beside the db; node 1 only says where it went.
    assert (dir0 / "final_summary.json").exists()
    assert "TraceML summary" not in "".join(node1.out)
    assert "its node holds the database and the summary" in err1
    assert not list(dir1.glob("*.db"))


def test_node_0_keeps_its_daemon_until_node_1s_final_batches_arrive(hosts: tuple[Host, Host], tmp_path: Path) -> None:
    """Node 1's batches go through a standalone relay whose way to the daemon opens
    only once node 0's own job ended: node 0 must wait for them, then stop."""
    token_file, dir0, dir1 = _setup(tmp_path)
    db = dir0 / "run.db"
    gate_file, gate_port, relay_port = tmp_path / "open", free_port(), free_port()
    (tmp_path / "gate.py").write_text(GATE)
    gate = subprocess.Popen(hosts[0].exec_prefix() + [
        sys.executable, str(tmp_path / "gate.py"), str(gate_port), str(DAEMON_PORT), str(gate_file)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    relay_log = tmp_path / "relay.log"
    with open(relay_log, "wb") as log:
        relay = subprocess.Popen(hosts[1].exec_prefix() + [
            sys.executable, "-m", "relay", "--port", str(relay_port), "--daemon", f"{hosts[0].address}:{gate_port}",
            "--token-file", str(token_file), "--node-rank", "1", "--spool-dir", str(tmp_path / "spool")],
            env=base_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "relay listening" in relay_log.read_text() or relay.poll() is not None, timeout=60,
                 what="the standalone relay")
        assert relay.poll() is None, relay_log.read_text()
        # Node 1's local rank 0 finds the relay port taken and sends to the standalone relay.
        node1 = _launch(hosts[1], 1, hosts[0], token_file, dir1, ["--relay-port", str(relay_port)])
        node0 = _launch(hosts[0], 0, hosts[0], token_file, dir0, ["--db", str(db)])
        assert node1.finish() == 0, node1.text
        assert node0.waiting.wait(300), node0.text
        gate_file.touch()
        assert node0.finish() == 0, node0.text
    finally:
        for proc in (relay, gate):
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert "stopped waiting" not in "".join(node0.err), node0.text
    _assert_whole_job_stored(db, "".join(node0.out))
