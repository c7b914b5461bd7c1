"""Spool records: clean scans, and a scan stops at the first corrupted record."""

from __future__ import annotations

import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from traceml_wire.spool import MAGIC, encode_record, scan


def _spool(bodies: list[bytes]) -> bytes:
    return MAGIC + b"".join(encode_record(b) for b in bodies)


def test_clean_round_trip() -> None:
    bodies = [b"a", b"", b"x" * 1000]
    result = scan(_spool(bodies))
    assert result.records == bodies and result.bad_offset is None


def test_magic_only_is_clean_and_empty() -> None:
    result = scan(MAGIC)
    assert result.records == [] and result.bad_offset is None


def test_bad_magic() -> None:
    for data in (b"", b"TRML", b"XXXXXXXX" + encode_record(b"a")):
        result = scan(data)
        assert result.records == [] and result.bad_offset == 0 and "magic" in result.reason


def test_truncated_header_and_body() -> None:
    good = _spool([b"one"])
    rec = encode_record(b"two-two")
    r1 = scan(good + rec[:5])
    assert r1.records == [b"one"] and r1.bad_offset == len(good) and "header" in r1.reason
    r2 = scan(good + rec[:-1])
    assert r2.records == [b"one"] and r2.bad_offset == len(good) and "body" in r2.reason


def test_crc_mismatch_stops_scan_and_keeps_prefix() -> None:
    a, b, c = encode_record(b"aaa"), bytearray(encode_record(b"bbb")), encode_record(b"ccc")
    b[-1] ^= 0x01
    data = MAGIC + a + bytes(b) + c
    result = scan(data)
    assert result.records == [b"aaa"]
    assert result.bad_offset == len(MAGIC) + len(a)
    assert result.reason == "CRC mismatch"


def test_length_over_cap() -> None:
    data = MAGIC + encode_record(b"ok") + struct.pack(">II", 10_000, 0)
    result = scan(data, max_record_bytes=100)
    assert result.records == [b"ok"] and "over cap" in result.reason


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=50), min_size=1, max_size=8), st.data())
def test_single_corruption_keeps_every_record_before_it(bodies: list[bytes], data: st.DataObject) -> None:
    clean = _spool(bodies)
    starts = []
    offset = len(MAGIC)
    for b in bodies:
        starts.append(offset)
        offset += 8 + len(b)
    pos = data.draw(st.integers(len(MAGIC), len(clean) - 1))
    flip = data.draw(st.integers(1, 255))
    corrupted = bytearray(clean)
    corrupted[pos] ^= flip
    # The record holding the damaged byte.
    hit = max(i for i, s in enumerate(starts) if s <= pos)
    result = scan(bytes(corrupted))
    # A flipped length byte may make a later boundary look valid only if CRC also
    # matches, which a single flip cannot achieve for the damaged record itself.
    assert result.records == bodies[:hit]
    assert result.bad_offset == starts[hit]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=30), max_size=6), st.integers(0, 400))
def test_truncation_anywhere_keeps_a_prefix(bodies: list[bytes], cut: int) -> None:
    clean = _spool(bodies)
    cut = min(cut, len(clean))
    result = scan(clean[:cut])
    assert result.records == bodies[: len(result.records)]
    boundaries = [len(MAGIC)]
    for body in bodies:
        boundaries.append(boundaries[-1] + 8 + len(body))
    if cut in boundaries:  # a cut between records reads as a shorter, clean spool
        assert result.bad_offset is None and len(result.records) == boundaries.index(cut)
    else:
        assert result.bad_offset is not None and result.bad_offset <= cut


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_garbage_never_raises(data: bytes) -> None:
    result = scan(MAGIC + data)
    assert (result.bad_offset is None) == (sum(8 + len(r) for r in result.records) == len(data))
