"""serve is bounded by default: raw rows for DEFAULT_RETENTION_DAYS and DEFAULT_MAX_DB_MB,
history kept; flags turn either off; what retention removed is counted and survives restarts."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.procs import DaemonProcess, cli, free_port, wait_for
from tests.traceml_daemon.history_support import batch, ro
from tests.traceml_daemon.wire_client import WireClient, agent_sender, steps_body
from traceml_daemon.commands.cli import UsageError, build_parser, serve_retention
from traceml_daemon.ingest.pipeline import StoreWriter
from traceml_daemon.store.read.history import run_series
from traceml_daemon.store.read.runs import RunRef
from traceml_daemon.store.retention import DEFAULT_MAX_DB_MB, DEFAULT_RETENTION_DAYS, RetentionPolicy
from traceml_wire import messages

STEPS = 200
WINDOW_DAYS = 0.0001  # 8.64 s of the run's own clock: steps 191..199 are within it, 0..190 are not
KEPT = 9


def _retention(*flags: str) -> tuple[float | None, float | None]:
    return serve_retention(build_parser("serve").parse_args(["serve", *flags]))


def test_serve_defaults_and_the_flags_that_turn_retention_off() -> None:
    assert (DEFAULT_RETENTION_DAYS, DEFAULT_MAX_DB_MB) == (14.0, 20480.0)
    assert _retention() == (14.0, 20480.0)
    assert _retention("--retention-days", "3", "--max-db-mb", "500") == (3.0, 500.0)
    assert _retention("--retention-days", "0") == (None, 20480.0)
    assert _retention("--max-db-mb", "0") == (14.0, None)
    assert _retention("--keep-everything") == (None, None)
    assert _retention("--keep-everything", "--retention-days", "0") == (None, None)
    with pytest.raises(UsageError, match="--keep-everything"):
        _retention("--keep-everything", "--max-db-mb", "100")
    assert RetentionPolicy.from_flags(*_retention("--keep-everything")) is None


def test_a_negative_window_is_refused(tmp_path: Path) -> None:
    done = cli("serve", "--db", str(tmp_path / "x.db"), "--retention-days", "-1")
    assert done.returncode == 2 and "--retention-days" in done.stderr


def test_age_counts_back_from_the_newest_row_so_a_replayed_run_is_kept(tmp_path: Path) -> None:
    """A database holding only an old run (a replay, a restored file) keeps it under the default
    window: nothing newer makes it old. Rows older than the newest by more than the window go."""
    db = tmp_path / "old.db"
    old = time.time() - 60 * 86400

    async def go() -> tuple[int, int]:
        writer = StoreWriter(str(db), retention=RetentionPolicy(max_age_s=DEFAULT_RETENTION_DAYS * 86400))
        await writer.open()
        assert await writer.write([batch(1, [0, 1], 0, 500, ts0=old)])
        kept = await writer.enforce_retention()
        assert await writer.write([batch(2, [0, 1], 500, 10, ts0=time.time() - 500)])
        deleted = await writer.enforce_retention()
        await writer.close()
        return kept, deleted

    assert asyncio.run(go()) == (0, 1000)
    conn = ro(db)
    assert conn.execute("SELECT count(*), min(step) FROM steps").fetchone() == (20, 500)
    conn.close()


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.read().decode()


def test_a_short_window_trims_raw_rows_and_history_still_draws_the_whole_run(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    metrics_port = free_port()
    daemon = DaemonProcess(db, args=["--retention-days", str(WINDOW_DAYS), "--metrics-port", str(metrics_port)])
    with daemon:
        with WireClient(daemon.port) as c:
            assert c.handshake("relay/s1/n0/9-r")["t"] == messages.ACCEPT
            items = [[agent_sender("s1", r), 1, steps_body(0, STEPS)] for r in (0, 1)]
            peers = {agent_sender("s1", r): {"global_rank": r, "node_rank": 0, "world_size": 2} for r in (0, 1)}
            c.rbatch(1, items, peers)
            assert c.recv() == {"t": "ack", "seq": 1}
        # A pass runs every few seconds: /metrics shows the count live, with the database's size.
        def deleted() -> str | None:
            text = _scrape(metrics_port)
            return text if _metric(text, "traceml_rows_deleted_by_retention_total") else None

        text = wait_for(deleted, timeout=60, what="a retention pass")
        assert _metric(text, "traceml_rows_deleted_by_retention_total") == 2 * (STEPS - KEPT)
        used = _metric(text, "traceml_database_used_bytes") or 0
        assert used > 0 and (_metric(text, "traceml_database_size_bytes") or 0) >= used
        assert daemon.stop() == 0, daemon.log()

    conn = ro(db)
    try:
        assert conn.execute("SELECT count(*), min(step), max(step) FROM steps").fetchone() == (2 * KEPT, STEPS - KEPT,
                                                                                              STEPS - 1)
        # History is never trimmed: the overview still spans step 0 to the last.
        points = run_series(conn, RunRef("s1", 0), width=50)
        assert points[0].first_step == 0 and points[-1].last_step == STEPS - 1
        assert sum(p.n for p in points) == 2 * STEPS
    finally:
        conn.close()

    # The count is a delivery counter: it survives a restart and the summary reports it.
    with DaemonProcess(db, args=["--keep-everything"]) as again:
        assert again.stop() == 0, again.log()
    done = cli("summary", "--db", str(db), "--json", "--no-files")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["delivery"]["rows_deleted_by_retention"] == 2 * (STEPS - KEPT)


def test_the_default_cap_is_applied_by_a_plain_serve(tmp_path: Path) -> None:
    """No flag: serve runs with both defaults (its log says which); --keep-everything says none."""
    db = tmp_path / "plain.db"
    with DaemonProcess(db) as daemon:
        assert daemon.stop() == 0
    assert "retention: raw rows kept 14 days, database capped at 20480 MiB" in daemon.log()
    with DaemonProcess(db, args=["--keep-everything"]) as daemon:
        assert daemon.stop() == 0
    assert "retention: off" in daemon.log()
    assert sqlite3.connect(db).execute("SELECT count(*) FROM steps").fetchone() == (0,)
