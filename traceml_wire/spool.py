"""Spool file records: CRC-checked, length-prefixed, append-only (pure).

Record = 4-byte big-endian length, 4-byte big-endian CRC32 of the body, body.
The body is a packed ``rbatch`` message, so a spool replays exactly like the
live stream. A reader stops at the first record whose header or CRC is bad and
reports its byte offset; every record before it is intact.
"""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

MAGIC = b"TRMLSPL1"
_RECORD = struct.Struct(">II")


def encode_record(body: bytes) -> bytes:
    return _RECORD.pack(len(body), zlib.crc32(body)) + body


MAX_RECORD_BYTES = 64 * 1024 * 1024


@dataclass
class SpoolScan:
    records: list[bytes] = field(default_factory=list)
    bad_offset: int | None = None  # offset of the first bad record, None if clean
    reason: str = ""


class RecordReader:
    """Stream one spool file's records without holding the file in memory.

    Iterating yields ``(offset of the record's body in the file, body)``, one
    record at a time. It stops at the first bad record; ``bad_offset`` and
    ``reason`` then say where and why (both unset for a clean file).
    """

    def __init__(self, fh: BinaryIO, max_record_bytes: int = MAX_RECORD_BYTES) -> None:
        self._fh = fh
        self.max_record_bytes = max_record_bytes
        self.bad_offset: int | None = None
        self.reason = ""

    def _bad(self, offset: int, reason: str) -> None:
        self.bad_offset, self.reason = offset, reason

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        fh = self._fh
        if fh.read(len(MAGIC)) != MAGIC:
            self._bad(0, "not a traceml spool (bad magic)")
            return
        offset = len(MAGIC)
        while True:
            header = fh.read(_RECORD.size)
            if not header:
                return
            if len(header) < _RECORD.size:
                self._bad(offset, "truncated record header")
                return
            length, crc = _RECORD.unpack(header)
            if length > self.max_record_bytes:
                self._bad(offset, f"record length {length} over cap")
                return
            body = fh.read(length)
            if len(body) < length:
                self._bad(offset, "truncated record body")
                return
            if zlib.crc32(body) != crc:
                self._bad(offset, "CRC mismatch")
                return
            yield offset + _RECORD.size, body
            offset += _RECORD.size + length


def scan(data: bytes, max_record_bytes: int = MAX_RECORD_BYTES) -> SpoolScan:
    """Every intact record of a spool held in memory (see RecordReader)."""
    reader = RecordReader(io.BytesIO(data), max_record_bytes)
    result = SpoolScan(records=[body for _, body in reader])
    result.bad_offset, result.reason = reader.bad_offset, reader.reason
    return result
