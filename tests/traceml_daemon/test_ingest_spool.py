"""`traceml-daemon ingest`: relay spool files through the live ingest path."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

from tests.support.procs import base_env
from tests.traceml_daemon.wire_client import agent_sender, steps_body
from traceml_wire import messages, spool
from traceml_wire.framing import pack_message

A0, A1 = agent_sender("s1", 0), agent_sender("s1", 1)
PEERS = {A0: {"global_rank": 0, "node_rank": 0}, A1: {"global_rank": 1, "node_rank": 0}}


def write_spool(path: Path, batches: int) -> list[int]:
    """One rbatch per record; returns each record's start offset."""
    data = bytearray(spool.MAGIC)
    offsets = []
    for seq in range(1, batches + 1):
        offsets.append(len(data))
        items = [[A0, seq, steps_body(seq * 10, 10)], [A1, seq, steps_body(seq * 10, 10)]]
        data += spool.encode_record(pack_message(messages.relay_batch(seq, items, PEERS, {"node_rank": 0}, {})))
    path.write_bytes(bytes(data))
    return offsets


def ingest(db: Path, *files: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "traceml_daemon", "ingest", *map(str, files), "--db", str(db)],
        capture_output=True, text=True, env=base_env(), timeout=120,
    )


def steps_in(db: Path) -> int:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT count(*) FROM steps").fetchone()[0]
    finally:
        conn.close()


def test_spool_ingest_stores_rows_and_dedups_a_second_load(tmp_path: Path) -> None:
    db, spool_file = tmp_path / "run.db", tmp_path / "relay.spool"
    write_spool(spool_file, 5)
    done = ingest(db, spool_file)
    assert done.returncode == 0, done.stderr
    assert "5 records, 100 rows stored" in done.stdout
    assert steps_in(db) == 100
    done = ingest(db, spool_file)
    assert done.returncode == 0, done.stderr
    assert "0 rows stored, 10 duplicate batches discarded" in done.stdout
    assert steps_in(db) == 100


def test_corrupted_spool_is_read_up_to_the_first_bad_record(tmp_path: Path) -> None:
    db, spool_file = tmp_path / "run.db", tmp_path / "relay.spool"
    offsets = write_spool(spool_file, 5)
    data = bytearray(spool_file.read_bytes())
    data[offsets[3] + 20] ^= 0xFF  # flip a byte inside record 4's body
    spool_file.write_bytes(bytes(data))
    done = ingest(db, spool_file)
    assert done.returncode == 0, done.stderr
    assert f"stopped at byte {offsets[3]}: CRC mismatch" in done.stdout
    assert steps_in(db) == 60
