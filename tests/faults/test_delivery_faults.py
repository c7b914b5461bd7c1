"""Issue 4's fault tests with real processes: a daemon killed mid-run, a
network partition, a daemon that never came up, hostile peers."""

from __future__ import annotations

import os
import random
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest

from tests.support.netns import Host, netns_unavailable_reason, two_hosts
from tests.support.procs import (
    EXAMPLES,
    DaemonProcess,
    base_env,
    cli,
    free_port,
    summary,
    torchrun,
    wait_for,
    wait_for_steps,
)

TRAIN = EXAMPLES / "train.py"


def _stored_steps(db: Path) -> int:
    s = summary(db)
    return sum(r["steps"] for r in s["ranks"]) if s else 0


def _assert_exact(s: dict, ranks: int, steps: int) -> None:
    assert len(s["ranks"]) == ranks, s["ranks"]
    assert all(r["steps"] == steps for r in s["ranks"]), [(r["global_rank"], r["steps"]) for r in s["ranks"]]
    assert all(r["first_step"] == 0 and r["last_step"] == steps - 1 for r in s["ranks"])
    assert s["delivery"]["rows_dropped_reported"] == 0, s["delivery"]
    assert s["delivery"]["batches_dropped_reported"] == 0, s["delivery"]


def test_daemon_kill9_mid_run_then_restart_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    db, steps = tmp_path / "restart.db", 300
    daemon = DaemonProcess(db).start()
    env = base_env(TRACEML_DAEMON=daemon.address, TRACEML_RELAY_PORT=str(free_port()), TRACEML_FLUSH_S="0.2")
    job = torchrun(TRAIN, ["--steps", str(steps), "--slow-ranks", "0,1", "--slow-ms", "15"], nproc=2, env=env,
                   background=True)
    try:
        wait_for(lambda: _stored_steps(db) >= 40, timeout=120, what="the first steps stored")
        daemon.kill9()
        time.sleep(2.0)  # the job keeps training while no daemon listens
        daemon = DaemonProcess(db, port=daemon.port).start()
        out = job.communicate(timeout=300)[0]
        assert job.returncode == 0, out
        s = wait_for_steps(db, ranks=2, steps=steps, timeout=120)
    finally:
        job.kill()
        daemon.stop()
    _assert_exact(s, ranks=2, steps=steps)


def test_daemon_unreachable_whole_run_then_ingest_spool(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    env = base_env(TRACEML_DAEMON=f"127.0.0.1:{free_port()}", TRACEML_RELAY_PORT=str(free_port()),
                   TRACEML_SPOOL_DIR=str(spool))
    done = torchrun(TRAIN, ["--steps", "40"], nproc=2, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    files = sorted(str(p) for p in spool.rglob("*") if p.is_file())
    assert files, "the relay wrote no spool"
    db = tmp_path / "late.db"
    loaded = cli("ingest", *files, "--db", str(db))
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr
    s = summary(db)
    assert s is not None
    _assert_exact(s, ranks=2, steps=40)


# ------------------------------------------------------------------ hostile input

def _hostile_peer(port: int, stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    attacks = [
        lambda: os.urandom(rng.randint(1, 4096)),  # random bytes
        lambda: struct.pack(">I", 0xFFFFFFFF),  # a 4 GiB length
        lambda: struct.pack(">I", 100) + b"\x81",  # truncated frame
        lambda: _frame({"t": "hello", "v": 1, "role": 7, "sender": None, "mac": "x"}),  # wrong types
        lambda: _frame({"t": "launch_missiles"}),  # unknown message type
        lambda: _frame({"t": "hello", "v": 1, "role": "relay", "sender": "evil", "session": "s",
                        "identity": {}, "mac": b"0" * 32}) * 50,  # hello flood, bad mac
        lambda: _frame([1, 2, 3]),  # not a map
    ]
    while not stop.is_set():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.settimeout(0.5)
                s.sendall(rng.choice(attacks)())
                try:
                    s.recv(4096)
                except OSError:
                    pass
        except OSError:
            time.sleep(0.05)


def _frame(obj: object) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def test_hostile_peers_do_not_hurt_a_good_job(tmp_path: Path) -> None:
    db, steps = tmp_path / "hostile.db", 200
    hostile_s = float(os.environ.get("TRACEML_HOSTILE_SECONDS", "30"))
    with DaemonProcess(db) as daemon:
        stop = threading.Event()
        peers = [threading.Thread(target=_hostile_peer, args=(daemon.port, stop, i), daemon=True) for i in range(4)]
        for p in peers:
            p.start()
        started = time.monotonic()
        try:
            env = base_env(TRACEML_DAEMON=daemon.address, TRACEML_RELAY_PORT=str(free_port()))
            done = torchrun(TRAIN, ["--steps", str(steps), "--slow-ranks", "0,1", "--slow-ms", "10"], nproc=2,
                            env=env)
            assert done.returncode == 0, done.stdout + done.stderr
            time.sleep(max(0.0, hostile_s - (time.monotonic() - started)))
        finally:
            stop.set()
            for p in peers:
                p.join(5)
        assert daemon.proc is not None and daemon.proc.poll() is None, "the daemon died:\n" + daemon.log()
        s = wait_for_steps(db, ranks=2, steps=steps)
    _assert_exact(s, ranks=2, steps=steps)


# ------------------------------------------------------------------ partition

NETNS = netns_unavailable_reason()


@pytest.mark.netns
@pytest.mark.skipif(NETNS is not None, reason=str(NETNS))
def test_link_down_20s_mid_run_loses_nothing(tmp_path: Path) -> None:
    db, steps, token = tmp_path / "partition.db", 400, "partition-secret"
    (tmp_path / "token").write_text(token)
    with two_hosts() as hosts:
        daemon = DaemonProcess(db, host="0.0.0.0", args=["--token-file", str(tmp_path / "token")],
                               netns=hosts[0].netns).start()
        try:
            jobs = _start_two_node_job(hosts, daemon.port, token, steps)
            wait_for(lambda: _stored_steps(db) >= 60, timeout=120, what="steps from both nodes")
            hosts[1].link(up=False)
            time.sleep(float(os.environ.get("TRACEML_PARTITION_SECONDS", "20")))
            hosts[1].link(up=True)
            for job in jobs:
                out = job.communicate(timeout=400)[0]
                assert job.returncode == 0, out
            s = wait_for_steps(db, ranks=4, steps=steps, timeout=120)
        finally:
            daemon.stop()
    _assert_exact(s, ranks=4, steps=steps)


def _start_two_node_job(hosts: tuple[Host, Host], daemon_port: int, token: str,
                        steps: int) -> list[subprocess.Popen[str]]:
    master_port, relay_port = free_port(), str(free_port())
    jobs = []
    for node, host in enumerate(hosts):
        env = base_env(TRACEML_DAEMON=f"{hosts[0].address}:{daemon_port}", TRACEML_TOKEN=token,
                       TRACEML_RELAY_PORT=relay_port, GLOO_SOCKET_IFNAME=host.ifname, TRACEML_SESSION="partition")
        cmd = host.exec_prefix() + [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
            "--node-rank", str(node), "--master-addr", hosts[0].address, "--master-port", str(master_port),
            str(TRAIN), "--steps", str(steps), "--slow-ranks", "0,1,2,3", "--slow-ms", "10"]
        jobs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return jobs
