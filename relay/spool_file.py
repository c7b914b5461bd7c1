"""On-disk overflow for packed rbatches the daemon has not acknowledged yet.

Records are ``traceml_wire.spool`` records (length, CRC32, packed rbatch) in
segment files that each start with the spool MAGIC. The spool only ever holds
the *oldest* unacknowledged rbatches (the memory buffer spills from its old
end), so replaying the spool before memory keeps the stream in seq order.

Segments let us free disk at record granularity without rewriting a file:
dropping or acknowledging the oldest record just moves the head, and a
segment whose records are all gone is unlinked. The disk I/O is synchronous on
purpose: spilling is the rare path, and doing it inline keeps the ordering
argument above trivially true.
"""

from __future__ import annotations

import bisect
import os
import stat
import struct
import zlib
from dataclasses import dataclass

from traceml_wire.spool import MAGIC, encode_record

_HEADER = struct.Struct(">II")
DEFAULT_SEGMENT_BYTES = 8 * 1024 * 1024


@dataclass(slots=True)
class Packed:
    """One packed rbatch plus the accounting needed when it is dropped."""

    seq: int
    data: bytes
    n_items: int
    body_bytes: int


@dataclass(slots=True)
class _Segment:
    path: str
    fd: int
    size: int
    live: int = 0  # records of this segment still in the index


@dataclass(slots=True)
class _Entry:
    seq: int
    segment: _Segment
    offset: int  # of the record header
    length: int  # of the packed rbatch
    n_items: int
    body_bytes: int


def ensure_private_dir(directory: str) -> None:
    """Create ``directory`` 0700, or accept an existing one only if this user owns it.

    Spooled rbatches hold every rank's telemetry and the default directory sits under
    a shared temporary folder, where another user could have made it first (to read
    the records, or to swap the folder under us). Refusals are PermissionErrors whose
    text says what to do; the caller warns once and keeps the data in memory.
    """
    directory = os.path.abspath(directory)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    uid = os.getuid()
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
        raise PermissionError(
            f"spool directory {directory} is not a directory owned by this user (uid {uid}); "
            "refusing to spool there: set TRACEML_SPOOL_DIR to a private directory"
        )
    parent = os.stat(os.path.dirname(directory))
    if parent.st_uid != uid and parent.st_mode & 0o022 and not parent.st_mode & stat.S_ISVTX:
        raise PermissionError(
            f"spool directory {directory} sits in a folder other users can write to; "
            "refusing to spool there: set TRACEML_SPOOL_DIR to a private directory"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(directory, 0o700)


class Spool:
    """Append-only, byte-capped spool; beyond the cap the oldest record goes."""

    def __init__(self, directory: str, cap_bytes: int, segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> None:
        if cap_bytes <= 0:
            raise ValueError("spool cap must be positive")
        self.directory = directory
        self.cap_bytes = cap_bytes
        self.segment_bytes = segment_bytes
        # Unique per process and instance so two relays sharing a dir never mix files.
        self._prefix = f"spool-{os.getpid()}-{os.urandom(3).hex()}"
        self._n_segments = 0
        self._entries: list[_Entry] = []
        self._seqs: list[int] = []  # parallel to _entries, for bisect
        self._head = 0
        self._writing: _Segment | None = None
        self.live_bytes = 0
        # Cumulative counters the relay reports upstream.
        self.spooled_records = 0
        self.dropped: list[Packed] = []  # drained by the owner to count drops

    def __len__(self) -> int:
        return len(self._entries) - self._head

    def first_seq(self) -> int | None:
        return self._seqs[self._head] if len(self) else None

    def append(self, packed: Packed) -> None:
        """Write one rbatch; then enforce the cap by dropping the oldest records."""
        segment = self._segment_for(len(packed.data))
        record = encode_record(packed.data)
        offset = segment.size
        os.write(segment.fd, record)
        segment.size += len(record)
        segment.live += 1
        self._entries.append(_Entry(packed.seq, segment, offset, len(packed.data), packed.n_items, packed.body_bytes))
        self._seqs.append(packed.seq)
        self.live_bytes += len(record)
        self.spooled_records += 1
        while self.live_bytes > self.cap_bytes and len(self):
            entry = self._pop_head()
            self.dropped.append(Packed(entry.seq, b"", entry.n_items, entry.body_bytes))

    def next_after(self, seq: int) -> Packed | None:
        """The oldest spooled rbatch with a seq above ``seq``, read back from disk.

        A record that fails its CRC (disk trouble) is dropped and counted rather
        than stalling the stream.
        """
        while True:
            i = bisect.bisect_right(self._seqs, seq, lo=self._head)
            if i >= len(self._entries):
                return None
            entry = self._entries[i]
            raw = os.pread(entry.segment.fd, _HEADER.size + entry.length, entry.offset)
            body = raw[_HEADER.size :]
            if len(raw) == _HEADER.size + entry.length and _HEADER.unpack_from(raw) == (entry.length, zlib.crc32(body)):
                return Packed(entry.seq, body, entry.n_items, entry.body_bytes)
            # Corrupt: remove it from the index and count it as dropped.
            self._remove_at(i)
            self.dropped.append(Packed(entry.seq, b"", entry.n_items, entry.body_bytes))
            seq = entry.seq

    def ack(self, seq: int) -> None:
        """Forget every record at or below ``seq`` (the daemon committed them)."""
        while len(self) and self._seqs[self._head] <= seq:
            self._pop_head()

    def close(self, keep_unacked: bool = True) -> list[str]:
        """Close every segment; return the paths kept on disk.

        Segments still holding unacknowledged records are kept by default so an
        operator can load them later with ``traceml-daemon ingest`` (the daemon
        dedups, so acked records that share a kept segment add nothing).
        """
        segments = {id(e.segment): e.segment for e in self._entries[self._head :]}
        if self._writing is not None:
            segments[id(self._writing)] = self._writing
        kept: list[str] = []
        for segment in segments.values():
            if keep_unacked and segment.live > 0:
                os.close(segment.fd)
                kept.append(segment.path)
            else:
                self._discard(segment)
        self._entries, self._seqs, self._head, self._writing, self.live_bytes = [], [], 0, None, 0
        return kept

    # ------------------------------------------------------------ internals

    def _segment_for(self, size: int) -> _Segment:
        seg = self._writing
        if seg is None or (seg.size + size > self.segment_bytes and seg.size > len(MAGIC)):
            ensure_private_dir(self.directory)
            self._n_segments += 1
            path = os.path.join(self.directory, f"{self._prefix}-{self._n_segments:06d}.trs")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o600)
            os.write(fd, MAGIC)
            if seg is not None and seg.live == 0:
                self._discard(seg)
            seg = self._writing = _Segment(path, fd, len(MAGIC))
        return seg

    def _pop_head(self) -> _Entry:
        entry = self._entries[self._head]
        self._head += 1
        self._release(entry)
        # Compact the index now and then so it does not grow with history.
        if self._head > 1024 and self._head * 2 > len(self._entries):
            del self._entries[: self._head]
            del self._seqs[: self._head]
            self._head = 0
        return entry

    def _remove_at(self, i: int) -> None:
        entry = self._entries.pop(i)
        del self._seqs[i]
        self._release(entry)

    def _release(self, entry: _Entry) -> None:
        self.live_bytes -= _HEADER.size + entry.length
        entry.segment.live -= 1
        if entry.segment.live == 0 and entry.segment is not self._writing:
            self._discard(entry.segment)

    @staticmethod
    def _discard(segment: _Segment) -> None:
        try:
            os.close(segment.fd)
        except OSError:
            pass
        try:
            os.unlink(segment.path)
        except OSError:
            pass
