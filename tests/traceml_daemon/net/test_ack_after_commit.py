"""The server's acknowledgement follows the commit, through the real daemon: an rbatch
whose write failed (for a reason that is not its data's) is never acknowledged, so the
relay keeps it and resends it; once the database heals the resend is stored once."""

from __future__ import annotations

from pathlib import Path

from tests.support.procs import DaemonProcess
from tests.traceml_daemon.ingest.faults import failing_inserts
from tests.traceml_daemon.wire_client import RELAY, WireClient, agent_sender, count_steps, peers_for, steps_body
from traceml_wire import messages


def _send(port: int) -> dict | None:
    with WireClient(port) as c:
        assert c.handshake(RELAY)["t"] == messages.ACCEPT
        c.rbatch(1, [[agent_sender("s1", 0), 1, steps_body(0, 10)]], peers_for(0))
        return c.recv()


def test_an_rbatch_whose_write_failed_is_not_acknowledged_and_its_resend_is_stored_once(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    heal = failing_inserts(db, "steps", kind="io")
    with DaemonProcess(db) as daemon:
        assert _send(daemon.port) is None  # closed without an ack: the relay keeps the rbatch
        assert count_steps(db) == 0
        heal.execute("UPDATE meta SET value='0' WHERE key='fail'")
        assert _send(daemon.port) == {"t": "ack", "seq": 1}
        assert daemon.stop() == 0
    assert count_steps(db) == 10
