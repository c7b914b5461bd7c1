"""Never lose a step to a queue: 100,000 sub-millisecond steps, every one stored.

A real training process (plain ``python``, so local rank 0 with its in-process
node relay) runs ``examples/fast_steps.py``: a one-layer model stepped in a
few hundred microseconds, which puts thousands of step rows a second through
the recorder, the sender's batches, the relay and the daemon's writer. The
daemon is stopped (it drains and commits everything acknowledged) before the
summary is read, so the count is final, not a snapshot.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import pytest

from tests.support.procs import EXAMPLES, DaemonProcess, base_env, free_port, summary

STEPS = 100_000

pytestmark = pytest.mark.slow


def test_every_one_of_100k_fast_steps_arrives(tmp_path: Path) -> None:
    db = tmp_path / "fast.db"
    daemon = DaemonProcess(db).start()
    try:
        env = base_env(TRACEML_DAEMON=daemon.address, TRACEML_RELAY_PORT=str(free_port()))
        done = subprocess.run([sys.executable, str(EXAMPLES / "fast_steps.py"), "--steps", str(STEPS)],
                              env=env, capture_output=True, text=True, timeout=240)
        output = done.stdout + done.stderr
        assert done.returncode == 0, output
        assert f"done {STEPS} steps" in done.stdout, output
        # The agent says nothing when nothing went wrong: a "[traceml]" line
        # would be a drop, a reconnect or a capture failure.
        assert [line for line in output.splitlines() if "[traceml]" in line] == [], output
    finally:
        code = daemon.stop()
    assert code == 0, daemon.log()

    s = summary(db)
    assert s is not None, daemon.log()
    assert len(s["ranks"]) == 1, s["ranks"]
    rank = s["ranks"][0]
    assert rank["global_rank"] == 0
    assert rank["steps"] == STEPS, rank
    assert rank["last_step"] - rank["first_step"] + 1 == STEPS, rank
    # The count alone would let a duplicate hide a gap: the stored step numbers
    # are STEPS distinct values, so contiguous from first to last.
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        total, distinct = conn.execute("SELECT count(*), count(DISTINCT step) FROM steps").fetchone()
    assert (total, distinct) == (STEPS, STEPS)
    delivery = s["delivery"]
    assert delivery["rows_dropped_reported"] == 0, delivery
    assert delivery["batches_dropped_reported"] == 0, delivery
    assert delivery["rows_stored"] >= STEPS, delivery
