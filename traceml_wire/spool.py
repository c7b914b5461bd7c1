"""Spool file records: CRC-checked, length-prefixed, append-only (pure).

Record = 4-byte big-endian length, 4-byte big-endian CRC32 of the body, body.
The body is a packed ``rbatch`` message, so a spool replays exactly like the
live stream. A reader stops at the first record whose header or CRC is bad and
reports its byte offset; every record before it is intact.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field

MAGIC = b"TRMLSPL1"
_RECORD = struct.Struct(">II")


def encode_record(body: bytes) -> bytes:
    return _RECORD.pack(len(body), zlib.crc32(body)) + body


@dataclass
class SpoolScan:
    records: list[bytes] = field(default_factory=list)
    bad_offset: int | None = None  # offset of the first bad record, None if clean
    reason: str = ""


def scan(data: bytes, max_record_bytes: int = 64 * 1024 * 1024) -> SpoolScan:
    result = SpoolScan()
    if not data.startswith(MAGIC):
        result.bad_offset = 0
        result.reason = "not a traceml spool (bad magic)"
        return result
    offset = len(MAGIC)
    while offset < len(data):
        if len(data) - offset < _RECORD.size:
            result.bad_offset, result.reason = offset, "truncated record header"
            break
        length, crc = _RECORD.unpack_from(data, offset)
        if length > max_record_bytes:
            result.bad_offset, result.reason = offset, f"record length {length} over cap"
            break
        start = offset + _RECORD.size
        body = data[start : start + length]
        if len(body) < length:
            result.bad_offset, result.reason = offset, "truncated record body"
            break
        if zlib.crc32(body) != crc:
            result.bad_offset, result.reason = offset, "CRC mismatch"
            break
        result.records.append(body)
        offset = start + length
    return result
