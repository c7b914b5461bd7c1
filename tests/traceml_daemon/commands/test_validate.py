"""`traceml-daemon validate`: a damaged database or spool is found and named, exit codes 0/1/2/3."""

from __future__ import annotations

import json
import shutil
import sqlite3
import struct
from pathlib import Path

import pytest

from tests.support.procs import cli
from tests.support.synth_db import SynthSpec, build
from tests.traceml_daemon.commands.test_ingest_spool import write_spool


@pytest.fixture(scope="module")
def good_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("validate") / "run.db"
    build(str(path), SynthSpec(steps=400))
    return path


def _copy(db: Path, tmp_path: Path) -> Path:
    out = tmp_path / "copy.db"
    shutil.copyfile(db, out)
    return out


def _root_page_offset(db: Path, name: str) -> int:
    """Byte offset of the b-tree page header of ``name``'s root page (page 1 has the file header first)."""
    con = sqlite3.connect(db)
    try:
        (page_size,) = con.execute("PRAGMA page_size").fetchone()
        (root,) = con.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (name,)).fetchone()
    finally:
        con.close()
    return (root - 1) * page_size + (100 if root == 1 else 0)


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_sound_database_passes_every_check(good_db: Path) -> None:
    done = cli("validate", "--db", str(good_db), "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["problem"] is None
    assert result["checks_passed"][:2] == ["integrity_check", "schema_version"]
    assert "counters" in result["checks_passed"]


def test_a_flipped_byte_in_a_btree_page_of_a_copy_is_found(good_db: Path, tmp_path: Path) -> None:
    bad = _copy(good_db, tmp_path)
    # The root page of steps is an interior page of a multi-page table: the first byte of its
    # cell content offset points SQLite at the wrong bytes.
    _flip(bad, _root_page_offset(bad, "steps") + 5)
    done = cli("validate", "--db", str(bad))
    assert done.returncode == 3, (done.stdout, done.stderr)
    assert "integrity_check" in done.stdout and "DAMAGED" in done.stdout
    assert "table steps" in done.stdout  # the damaged tree is named by its table
    assert cli("validate", "--db", str(good_db)).returncode == 0  # the original is untouched


def test_a_flipped_byte_in_an_index_is_found(good_db: Path, tmp_path: Path) -> None:
    bad = _copy(good_db, tmp_path)
    _flip(bad, _root_page_offset(bad, "steps_by_group") + 3)  # its cell count
    done = cli("validate", "--db", str(bad))
    assert done.returncode == 3, (done.stdout, done.stderr)
    assert "integrity_check" in done.stderr


def test_a_row_of_an_unknown_rank_is_named(good_db: Path, tmp_path: Path) -> None:
    bad = _copy(good_db, tmp_path)
    con = sqlite3.connect(bad)
    con.execute("INSERT INTO scalars (rank_id, step, name, value) VALUES (77, 1, 'loss', 1.0)")
    (rowid,) = con.execute("SELECT max(rowid) FROM scalars").fetchone()
    con.commit()
    con.close()
    done = cli("validate", "--db", str(bad))
    assert done.returncode == 3
    assert f"known_ranks: scalars row {rowid}: rank_id 77 is not in the ranks table" in done.stdout


def test_a_counter_that_went_backwards_is_named(good_db: Path, tmp_path: Path) -> None:
    bad = _copy(good_db, tmp_path)
    con = sqlite3.connect(bad)
    con.execute("INSERT INTO drops (rank_id, ts, source, count) VALUES (1, 1.0, 'zz_test', 5)")
    con.execute("INSERT INTO drops (rank_id, ts, source, count) VALUES (1, 2.0, 'zz_test', 4)")
    con.commit()
    con.close()
    done = cli("validate", "--db", str(bad))
    assert done.returncode == 3
    assert "counters: drops row" in done.stdout and "went from 5 to 4" in done.stdout


def test_a_newer_schema_version_fails(good_db: Path, tmp_path: Path) -> None:
    bad = _copy(good_db, tmp_path)
    con = sqlite3.connect(bad)
    con.execute("UPDATE meta SET value = '999' WHERE key = 'schema_version'")
    con.commit()
    con.close()
    done = cli("validate", "--db", str(bad))
    assert done.returncode == 3
    assert "schema_version" in done.stdout and "newer" in done.stdout


def test_missing_and_non_database_files(tmp_path: Path) -> None:
    done = cli("validate", "--db", str(tmp_path / "nope.db"))
    assert done.returncode == 2
    assert "no such file" in done.stderr
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"hello, not sqlite" * 100)
    done = cli("validate", "--db", str(junk))
    assert done.returncode == 3
    assert "not an SQLite 3 database" in done.stdout


def test_usage_errors_exit_1(tmp_path: Path) -> None:
    assert cli("validate").returncode == 1
    assert cli("validate", "--db", "a", "--spool", "b").returncode == 1
    assert cli("validate", "--db", "a", "--bogus").returncode == 1


def test_a_sound_spool_directory_passes(tmp_path: Path) -> None:
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    write_spool(spool_dir / "spool-1-000001.trs", 5)
    (spool_dir / "notes.txt").write_text("not a segment")  # only *.trs files are spool segments
    done = cli("validate", "--spool", str(spool_dir), "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["files"][0]["records"] == 5 and result["files"][0]["items"] == 10


def test_a_flipped_byte_in_a_spool_file_is_found_with_its_offset(tmp_path: Path) -> None:
    spool_dir = tmp_path / "spool"
    spool_dir.mkdir()
    segment = spool_dir / "spool-1-000001.trs"
    offsets = write_spool(segment, 5)
    _flip(segment, offsets[2] + 30)  # inside record 3's body
    done = cli("validate", "--spool", str(spool_dir))
    assert done.returncode == 3
    assert f"{segment}: record at byte {offsets[2]}: CRC mismatch" in done.stdout
    assert "2 sound records before it" in done.stdout


def test_an_intact_record_that_is_not_an_rbatch_is_named(tmp_path: Path) -> None:
    from traceml_wire import spool

    segment = tmp_path / "one.trs"
    offsets = write_spool(segment, 2)
    data = segment.read_bytes() + spool.encode_record(b"\x93\x01\x02\x03")  # CRC holds, content does not
    segment.write_bytes(data)
    end = len(data) - len(spool.encode_record(b"\x93\x01\x02\x03"))
    done = cli("validate", "--spool", str(segment))
    assert done.returncode == 3
    assert f"record at byte {end}: not a valid rbatch" in done.stdout
    assert offsets[0] == len(spool.MAGIC)


def test_a_length_beyond_the_file_is_a_truncated_record(tmp_path: Path) -> None:
    segment = tmp_path / "one.trs"
    offsets = write_spool(segment, 3)
    data = bytearray(segment.read_bytes())
    struct.pack_into(">I", data, offsets[1], 10_000)
    segment.write_bytes(bytes(data))
    done = cli("validate", "--spool", str(segment))
    assert done.returncode == 3
    assert f"record at byte {offsets[1]}: truncated record body" in done.stdout


def test_a_missing_spool_is_an_io_error(tmp_path: Path) -> None:
    done = cli("validate", "--spool", str(tmp_path / "none"))
    assert done.returncode == 2
    assert "no such file or directory" in done.stderr


def test_segments_written_by_the_relays_spool_are_checked(tmp_path: Path) -> None:
    from relay.spool_file import Packed, Spool
    from tests.traceml_daemon.commands.test_ingest_spool import A0, PEERS
    from tests.traceml_daemon.wire_client import steps_body
    from traceml_wire import messages
    from traceml_wire.framing import pack_message

    spool_dir = tmp_path / "spool"
    spool = Spool(str(spool_dir), cap_bytes=1 << 20, segment_bytes=4096)  # small segments: several files
    for seq in range(1, 9):
        data = pack_message(messages.relay_batch(seq, [[A0, seq, steps_body(seq * 10, 10)]], PEERS,
                                                 {"node_rank": 0}, {}, sender="relay/s1/n0/1-ab"))
        spool.append(Packed(seq=seq, data=data, n_items=1, body_bytes=len(data)))
    kept = sorted(spool.close(keep_unacked=True))
    assert len(kept) > 1
    done = cli("validate", "--spool", str(spool_dir), "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    assert sum(f["records"] for f in json.loads(done.stdout)["files"]) == 8
    _flip(Path(kept[-1]), len(Path(kept[-1]).read_bytes()) - 3)  # the last record's body
    done = cli("validate", "--spool", str(spool_dir))
    assert done.returncode == 3 and f"{kept[-1]}: record at byte" in done.stdout and "CRC mismatch" in done.stdout
