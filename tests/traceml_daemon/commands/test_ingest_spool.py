"""`traceml-daemon ingest`: relay spool files through the live ingest path."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.procs import base_env
from tests.traceml_daemon.wire_client import agent_sender, count_steps, steps_body
from traceml_wire import messages, spool
from traceml_wire.body import encode_body
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


def test_spool_ingest_stores_rows_and_dedups_a_second_load(tmp_path: Path) -> None:
    db, spool_file = tmp_path / "run.db", tmp_path / "relay.spool"
    write_spool(spool_file, 5)
    done = ingest(db, spool_file)
    assert done.returncode == 0, done.stderr
    assert "5 records, 100 rows stored" in done.stdout
    assert count_steps(db) == 100
    done = ingest(db, spool_file)
    assert done.returncode == 0, done.stderr
    assert "0 rows stored, 10 duplicate batches discarded" in done.stdout
    assert count_steps(db) == 100


def test_corrupted_spool_is_read_up_to_the_first_bad_record(tmp_path: Path) -> None:
    db, spool_file = tmp_path / "run.db", tmp_path / "relay.spool"
    offsets = write_spool(spool_file, 5)
    data = bytearray(spool_file.read_bytes())
    data[offsets[3] + 20] ^= 0xFF  # flip a byte inside record 4's body
    spool_file.write_bytes(bytes(data))
    done = ingest(db, spool_file)
    assert done.returncode == 0, done.stderr
    assert f"stopped at byte {offsets[3]}: CRC mismatch" in done.stdout
    assert count_steps(db) == 60


def write_records(path: Path, records: list[tuple[int, list[list[object]]]]) -> None:
    """One rbatch per (relay seq, items) record."""
    data = bytearray(spool.MAGIC)
    for seq, items in records:
        data += spool.encode_record(pack_message(messages.relay_batch(seq, items, PEERS, {"node_rank": 0}, {})))
    path.write_bytes(bytes(data))


def batch(sender: str, seq: int) -> list[object]:
    return [sender, seq, steps_body(seq * 10, 10)]


def step_numbers(db: Path) -> dict[int, list[int]]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT r.global_rank, s.step FROM steps s JOIN ranks r USING (rank_id) ORDER BY 1, 2")
        out: dict[int, list[int]] = {}
        for rank, step in rows:
            out.setdefault(rank, []).append(step)
        return out
    finally:
        conn.close()


def test_files_out_of_seq_order_ingest_completely(tmp_path: Path) -> None:
    # A relay restarted mid-run: its second life's segments sort first by name, and
    # it resent seq 5, which the first life had spooled too.
    first, second = tmp_path / "spool-900-aaaaaa-000001.trs", tmp_path / "spool-1000-bbbbbb-000001.trs"
    write_records(first, [(s, [batch(A0, s), batch(A1, s)]) for s in range(1, 6)])
    write_records(second, [(s - 4, [batch(A0, s), batch(A1, s)]) for s in range(5, 11)])
    db = tmp_path / "run.db"
    done = ingest(db, *sorted([first, second]))
    assert done.returncode == 0, done.stderr
    assert step_numbers(db) == {0: list(range(10, 110)), 1: list(range(10, 110))}
    # Seq 5 of both ranks is in both files: stored once, from the file named first.
    lines = done.stdout.splitlines()
    assert f"{second}: 6 records, 120 rows stored, 0 duplicate batches discarded" in lines
    assert f"{first}: 5 records, 80 rows stored, 2 duplicate batches discarded" in lines


def test_each_sender_is_ordered_even_where_no_file_order_works(tmp_path: Path) -> None:
    # Rank 0's early batches are in x, rank 1's in y: neither order of the two files is
    # right for both senders, so ordering has to be per sender.
    x, y = tmp_path / "x.trs", tmp_path / "y.trs"
    write_records(x, [(1, [batch(A0, s) for s in range(1, 6)] + [batch(A1, s) for s in range(6, 11)])])
    write_records(y, [(1, [batch(A0, s) for s in range(6, 11)] + [batch(A1, s) for s in range(1, 6)])])
    for order in ((x, y), (y, x)):
        db = tmp_path / f"{order[0].stem}.db"
        done = ingest(db, *order)
        assert done.returncode == 0, done.stderr
        assert step_numbers(db) == {0: list(range(10, 110)), 1: list(range(10, 110))}
        assert "0 duplicate batches discarded" in done.stdout and "100 rows stored" in done.stdout


def test_parse_rbatch_locates_every_body_and_refuses_what_the_live_path_refuses() -> None:
    from traceml_daemon.commands.ingest import parse_rbatch
    from traceml_wire.errors import ProtocolError

    bodies = [b"", b"a" * 10, b"b" * 300, b"c" * 70_000]  # bin8, bin8, bin16, bin32 headers
    items: list[list[object]] = [[A0, seq, body] for seq, body in enumerate(bodies, 1)]
    record = pack_message(messages.relay_batch(9, items, PEERS, {"node_rank": 0}, {"dropped_batches": 2}))
    message, spans = parse_rbatch(record)
    assert [record[o : o + n] for o, n in spans] == bodies
    assert message["items"] == [[A0, seq, b""] for seq in range(1, 5)] and message["stats"] == {"dropped_batches": 2}
    bad_body = pack_message(messages.relay_batch(9, [[A0, 1, "text, not bytes"]], PEERS, {}, {}))
    with pytest.raises(ProtocolError):
        messages.validate_client_message(parse_rbatch(bad_body)[0])
    for broken in (record + b"\x00", record[:-1], b"\x93\x01\x02\x03"):
        with pytest.raises(ProtocolError):
            parse_rbatch(broken)


def quarantined(db: Path) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT sender, seq, reason FROM quarantine ORDER BY id").fetchall()
    finally:
        conn.close()


def test_bad_records_with_valid_crcs_are_named_and_everything_around_them_stored(tmp_path: Path) -> None:
    """Intact records that cannot be stored as they are: one not an rbatch, one whose
    item seq is beyond int64, one whose relay counter is a uint64. The good records
    before, between and after them are stored, each bad one named by offset and reason."""
    relay = "relay/s1/n0/9-r"
    good = [pack_message(messages.relay_batch(s, [batch(A0, s)], PEERS, {"node_rank": 0}, {}, sender=relay))
            for s in (1, 2, 3, 4)]
    records = [
        good[0],
        pack_message({"t": "rbatch", "seq": 7, "items": {"not": "a list"}}),
        good[1],
        pack_message(messages.relay_batch(8, [[A1, 2**64 - 1, steps_body(0, 10)]], PEERS, {"node_rank": 0}, {},
                                          sender=relay)),
        good[2],
        pack_message(messages.relay_batch(9, [], PEERS, {"node_rank": 0}, {"dropped_batches": 2**64 - 1,
                                                                             "spooled_batches": 5}, sender=relay)),
        good[3],
    ]
    data = bytearray(spool.MAGIC)
    offsets = []
    for record in records:
        offsets.append(len(data))
        data += spool.encode_record(record)
    spool_file, db = tmp_path / "relay.spool", tmp_path / "run.db"
    spool_file.write_bytes(bytes(data))
    done = ingest(db, spool_file)
    assert done.returncode == 0, done.stderr
    assert step_numbers(db) == {0: list(range(10, 50))}
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith(f"{spool_file}: 7 records, 40 rows stored"), line
    assert "1 invalid records skipped, 3 bad (" in line, line
    assert f"byte {offsets[1]}: record is not a packed map: ValueError" in line, line
    assert f"byte {offsets[3]}: batch set aside: seq outside 1..2**63-1" in line, line
    assert f"byte {offsets[5]}: 1 relay counters refused" in line, line
    assert quarantined(db) == [(A1, str(2**64 - 1), "seq outside 1..2**63-1")]
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    relay_counters = dict(conn.execute("SELECT counter, value FROM delivery WHERE source=?", ("relay:" + relay,)))
    assert relay_counters == {"spooled_batches": 5}
    daemon = dict(conn.execute("SELECT counter, value FROM delivery WHERE source='daemon'"))
    conn.close()
    assert (daemon["batches_quarantined"], daemon["stats_refused"]) == (1, 1)


def test_a_spool_beyond_every_bound_is_ingested_within_them(tmp_path: Path) -> None:
    """What a spool may hold that no frame lets through (traceml_wire/framing.py): 20,000
    senders of 1 KB, an 8 MB sender and 50,000 counters in one record. The daemon's own
    bounds (traceml_wire/bounds.py) apply, every sender there is too long, and the good
    record after it is stored exactly."""
    from traceml_wire.bounds import MAX_STATS_KEYS

    relay = "relay/s1/n0/9-r"
    empty = encode_body({})
    many = [[f"{i:05d}" + "x" * 1019, 1, empty] for i in range(20_000)]
    hostile = messages.relay_batch(1, [["h" * (8 << 20), 1, steps_body(0, 5)], *many], {}, {"node_rank": 0},
                                   {f"counter_{i}": i for i in range(50_000)}, sender=relay)
    follow = messages.relay_batch(2, [batch(A0, 1)], PEERS, {"node_rank": 0}, {}, sender=relay)
    spool_file, db = tmp_path / "relay.spool", tmp_path / "run.db"
    spool_file.write_bytes(spool.MAGIC + spool.encode_record(pack_message(hostile))
                           + spool.encode_record(pack_message(follow)))
    done = ingest(db, spool_file)
    assert done.returncode == 0, done.stderr
    assert step_numbers(db) == {0: list(range(10, 20))}
    set_aside = 20_000 + 1
    line = done.stdout.strip().splitlines()[-1]
    assert f"{set_aside + 1} bad (byte 8: 49936 relay counters refused" in line, line
    assert "byte 8: batch set aside: sender of 1024 characters (at most 256)" in line, line
    assert line.endswith(f"; and {set_aside + 1 - 20} more)"), line
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    assert conn.execute("SELECT count(*) FROM ranks").fetchone() == (1,)
    assert conn.execute("SELECT count(*) FROM delivery WHERE source=?", ("relay:" + relay,)).fetchone() == (
        MAX_STATS_KEYS,)
    daemon = dict(conn.execute("SELECT counter, value FROM delivery WHERE source='daemon'"))
    assert (daemon["batches_quarantined"], daemon["stats_refused"]) == (set_aside, 50_000 - MAX_STATS_KEYS)
    # The table keeps its newest rows, each sender cut short.
    assert conn.execute("SELECT count(*), max(length(sender)) < 400 FROM quarantine").fetchone() == (10_000, 1)
    conn.close()
