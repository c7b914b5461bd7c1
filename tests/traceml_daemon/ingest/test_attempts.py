"""Elastic restarts: the data of two attempts of one session never mixes.

torchelastic restarts every worker of a failed job with a higher
``TORCHELASTIC_RESTART_COUNT``; the agent puts it in its sender id
(``{session}/a{attempt}/n{node}/r{rank}/...``) and its identity. Here relays
made of ``WireClient`` speak the real wire to a real daemon, as the relays of
both attempts would, and ``traceml-daemon summary --json`` must describe the
newest attempt alone while listing every attempt it saw.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support.procs import DaemonProcess, summary
from tests.traceml_daemon.wire_client import WireClient, agent_sender, steps_body
from traceml_wire import messages

SESSION = "elastic-job"
FIRST_MS, SECOND_MS = 50, 20  # step time of attempt 0 / attempt 1: a mixed median shows


def send_attempt(port: int, attempt: int, node: int, ranks: list[int], first_step: int, steps: int, step_ms: int,
                 world_size: int, nnodes: int, agent_seq: int = 1) -> None:
    """One node's relay of ``attempt`` forwards one batch per rank and waits for the ack."""
    with WireClient(port) as relay:
        accepted = relay.handshake(f"relay/{SESSION}/n{node}/{4000 + attempt}-r{attempt}", session=SESSION)
        assert accepted is not None and accepted["t"] == messages.ACCEPT, accepted
        items: list[list[Any]] = []
        peers: dict[str, dict[str, Any]] = {}
        for local, rank in enumerate(ranks):
            sender = agent_sender(SESSION, rank, node=node, attempt=attempt)
            items.append([sender, agent_seq, steps_body(first_step, steps, step_ns=step_ms * 1_000_000)])
            peers[sender] = {"global_rank": rank, "local_rank": local, "node_rank": node, "world_size": world_size,
                             "nnodes": nnodes, "local_world_size": len(ranks), "hostname": f"host{node}",
                             "run_id": SESSION, "attempt": attempt, "parallelism": "ddp"}
        relay.rbatch(1, items, peers, node={"node_rank": node, "hostname": f"host{node}"}, stats={"dropped_batches": 0})
        assert relay.recv() == {"t": messages.ACK, "seq": 1}


def final_summary(db: Path, daemon: DaemonProcess) -> dict[str, Any]:
    assert daemon.stop() == 0, daemon.log()  # drained: everything acknowledged is committed
    s = summary(db)
    assert s is not None, daemon.log()
    return s


def test_summary_reports_the_latest_attempt_only(tmp_path: Path) -> None:
    """Attempt 0 ran 2 nodes x 2 ranks for 30 steps and failed; attempt 1 resumed
    from a checkpoint at step 20 on one node with 2 ranks (an elastic scale-down),
    so the step numbers 20..29 of both attempts overlap."""
    db = tmp_path / "run.db"
    daemon = DaemonProcess(db).start()
    for node in (0, 1):
        send_attempt(daemon.port, 0, node, [node * 2, node * 2 + 1], first_step=0, steps=30, step_ms=FIRST_MS,
                     world_size=4, nnodes=2)
    send_attempt(daemon.port, 1, 0, [0, 1], first_step=20, steps=15, step_ms=SECOND_MS, world_size=2, nnodes=1)
    s = final_summary(db, daemon)

    assert s["session"] == SESSION
    assert s["attempt"] == 1
    assert s["attempts"] == [0, 1]
    assert s["topology"] == {"nnodes": 1, "world_size": 2, "parallelism": "ddp"}
    ranks = s["ranks"]
    # Ranks 2 and 3 existed only in attempt 0.
    assert [(r["global_rank"], r["node_rank"]) for r in ranks] == [(0, 0), (1, 0)]
    for r in ranks:
        # Attempt 1's own 15 steps: none of attempt 0's 30, though ranks 0 and 1
        # and steps 20..29 exist in both.
        assert (r["steps"], r["first_step"], r["last_step"]) == (15, 20, 34), r
        assert r["step_ms_median"] == float(SECOND_MS), r
    assert [(n["node_rank"], n["ranks"]) for n in s["nodes"]] == [(0, [0, 1])]
    assert s["delivery"]["duplicates_discarded"] == 0


def test_late_data_of_an_earlier_attempt_stays_out_of_the_new_one(tmp_path: Path) -> None:
    """A relay of attempt 0 delivers its last buffered batch after attempt 1 began
    (resend after a reconnect): it is stored under attempt 0, and attempt 1 stays
    the run the summary describes."""
    db = tmp_path / "run.db"
    daemon = DaemonProcess(db).start()
    send_attempt(daemon.port, 0, 0, [0, 1], first_step=0, steps=10, step_ms=FIRST_MS, world_size=2, nnodes=1)
    send_attempt(daemon.port, 1, 0, [0, 1], first_step=0, steps=8, step_ms=SECOND_MS, world_size=2, nnodes=1)
    # Attempt 0's next batch (agent seq 2, steps 10..19) arrives last.
    send_attempt(daemon.port, 0, 0, [0, 1], first_step=10, steps=10, step_ms=FIRST_MS, world_size=2, nnodes=1,
                 agent_seq=2)
    s = final_summary(db, daemon)

    assert s["session"] == SESSION
    assert (s["attempt"], s["attempts"]) == (1, [0, 1])
    assert [r["global_rank"] for r in s["ranks"]] == [0, 1]
    for r in s["ranks"]:
        assert (r["steps"], r["first_step"], r["last_step"]) == (8, 0, 7), r
        assert r["step_ms_median"] == float(SECOND_MS), r
    # The late batch was new data for attempt 0's senders, not a duplicate:
    # every row of both attempts was stored.
    delivery = s["delivery"]
    assert delivery["duplicates_discarded"] == 0
    assert delivery["rows_stored"] == 2 * (10 + 8 + 10)
    # The TUI shows the same run as the summary, not the attempt seen last.
    from traceml_daemon.tui.data import TuiData

    header = TuiData(str(db)).overview().header
    assert (header.attempt, header.world_size) == (1, 2)
