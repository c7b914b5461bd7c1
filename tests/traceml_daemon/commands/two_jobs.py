"""Two jobs on one daemon: two relays, each of its own session, sending steps interleaved.

The tests of ``runs``, ``--session`` and the TUI's run picker read what the real
daemon stores from this traffic (``tests/traceml_daemon/wire_client.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from tests.traceml_daemon.wire_client import WireClient, agent_sender
from traceml_wire import messages
from traceml_wire.body import encode_body


@dataclass(frozen=True)
class Job:
    session: str
    ranks: int
    hostname: str
    step_ms: int
    steps: int  # stored per rank
    finishes: bool  # its last batch says every rank finished


JOB_A = Job("job-a", ranks=2, hostname="host-a", step_ms=20, steps=30, finishes=True)
# A session id holding ':' (the agent derives MASTER_ADDR:MASTER_PORT when nothing else is set).
JOB_B = Job("10.0.0.7:29500", ranks=3, hostname="host-b", step_ms=35, steps=40, finishes=False)
BATCH_STEPS = 10


def body(job: Job, first: int, n: int, last: bool) -> bytes:
    steps = list(range(first, first + n))
    ms = 1_000_000
    cols: dict[str, list[Any]] = {
        "step": steps,
        "ts": [time.time() - (first + n - s) * 0.01 for s in steps],
        "step_ns": [job.step_ms * ms] * n,
        "dataloader_ns": [2 * ms] * n,
        "forward_ns": [(job.step_ms - 10) * ms] * n,
        "backward_ns": [6 * ms] * n,
        "optimizer_ns": [2 * ms] * n,
        "rss_bytes": [1 << 30] * n,
    }
    tables: dict[str, dict[str, list[Any]]] = {"steps": cols}
    if last:
        now = time.time()
        tables["status"] = {"ts": [now], "phase": ["idle"], "phase_since": [now], "step": [steps[-1]],
                            "steps_done": [first + n], "finished": [int(job.finishes)]}
    return encode_body(tables, sent_ts=time.time())


class Relay:
    """One job's relay: a real wire connection to the daemon, batches numbered from 1."""

    def __init__(self, port: int, job: Job) -> None:
        self.job = job
        self.client = WireClient(port)
        self.seq = 0
        reply = self.client.handshake(f"relay/{job.session}/n0/1-r", session=job.session)
        assert reply is not None and reply["t"] == messages.ACCEPT, reply
        self.peers = {
            agent_sender(job.session, r): {"global_rank": r, "local_rank": r, "node_rank": 0, "world_size": job.ranks,
                                           "nnodes": 1, "hostname": job.hostname}
            for r in range(job.ranks)
        }

    def send(self, first: int) -> None:
        """Steps ``first`` .. ``first + BATCH_STEPS - 1`` of every rank, acknowledged (stored)."""
        self.seq += 1
        n = min(BATCH_STEPS, self.job.steps - first)
        last = first + n >= self.job.steps
        items = [[sender, self.seq, body(self.job, first, n, last)] for sender in self.peers]
        self.client.rbatch(self.seq, items, self.peers, node={"node_rank": 0, "hostname": self.job.hostname})
        assert self.client.recv() == {"t": messages.ACK, "seq": self.seq}

    def close(self) -> None:
        self.client.close()


def send_interleaved(port: int, jobs: tuple[Job, ...] = (JOB_A, JOB_B)) -> None:
    """Both jobs connected at once, their batches alternating until each sent all its steps."""
    relays = [Relay(port, job) for job in jobs]
    try:
        for first in range(0, max(job.steps for job in jobs), BATCH_STEPS):
            for relay in relays:
                if first < relay.job.steps:
                    relay.send(first)
    finally:
        for relay in relays:
            relay.close()
