"""``traceml-daemon ingest``: load relay spool files into a database.

A spool record is a packed ``rbatch``, so replaying one goes through exactly
the live path (Ingestor + StoreWriter): the same dedup applies, and a spool
whose batches already arrived live adds nothing. A record that is intact (its
CRC holds) but not a valid rbatch is skipped, an item the writer sets aside
(``traceml_daemon/ingest/quarantine.py``) is kept in ``quarantine``, and
everything around them is stored; the report line names each (byte offset of
its record, reason). A record whose CRC fails ends the file's reading there:
its length cannot be trusted to find the next one.

Order matters: the daemon dedups by a per-sender high-water mark, so an agent
batch staged after a later one of the same sender would be discarded as a
duplicate. Files may come in any order (a restarted relay's segments carry
another ``spool-{pid}`` prefix, which sorts arbitrarily), so ingest runs in two
passes with bounded memory:

1. index: stream every record once; keep, per item, only (sender, seq, file,
   byte range of its body, identity), never the bodies themselves;
2. stage: per sender in seq order, reading each body from its file when its
   turn comes. Senders are interleaved by file position, so files that were
   given in order are read front to back, one transaction run per file.

Each relay's counters (spool cap drops and the rest) are stored from the newest
rbatch that names its relay (``sender``), under the source the live path uses,
with the same monotonic upsert: a relay that also reported live is not counted
twice. Spools from relays that did not name themselves carry no usable stats.
An rbatch the relay's spool cap dropped can still be on disk (a segment is
deleted only once all its records are gone); the relay counted it as lost, so
it is skipped (``spool_dropped_upto``): stored rows and reported drops never
overlap.
"""

from __future__ import annotations

import heapq
import os
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack

from traceml_daemon.ingest.pipeline import StoreWriter, WorkItem
from traceml_daemon.ingest.quarantine import Quarantined
from traceml_wire import messages, spool
from traceml_wire.bounds import clean_stats
from traceml_wire.errors import ProtocolError
from traceml_wire.printable import printable

TXN_BYTES = 32 * 1024 * 1024
NAMED = 20  # bad records a report line names; the rest are counted
_RECORD_HEADER = 8  # a spool record's length and CRC, before its body (traceml_wire/spool.py)
MAX_OPEN_FILES = 64  # bodies are read back by offset; cap the descriptors held meanwhile
# msgpack bin8/bin16/bin32 markers and their header sizes: an item body's bytes
# start right after the header, so the index can point into the file.
_BIN_HEADER = {0xC4: 2, 0xC5: 3, 0xC6: 5}
# A sender missing from an rbatch's peers: one shared object, so its batches still
# group into one work item (identities are compared by identity, see _Transaction).
_NO_IDENTITY: dict[str, Any] = {}


@dataclass
class SpoolReport:
    path: str
    records: int = 0  # intact records read
    rbatches: int = 0  # records that held a valid rbatch
    invalid_records: int = 0  # intact records that were not a valid rbatch
    rows_stored: int = 0
    duplicates_discarded: int = 0
    relay_dropped: int = 0  # agent batches the relay had counted as dropped: skipped
    bad_offset: int | None = None
    reason: str = ""
    # (byte offset of the record, reason) of every record skipped, item set aside or
    # relay counter refused, in file order.
    bad: list[tuple[int, str]] = field(default_factory=list)

    def line(self) -> str:
        text = (
            f"{self.path}: {self.records} records, {self.rows_stored} rows stored, "
            f"{self.duplicates_discarded} duplicate batches discarded"
        )
        if self.relay_dropped:
            text += f", {self.relay_dropped} batches the relay had counted as dropped skipped"
        if self.invalid_records:
            text += f", {self.invalid_records} invalid records skipped"
        if self.bad:
            named = "; ".join(f"byte {offset}: {reason}" for offset, reason in sorted(self.bad)[:NAMED])
            more = f"; and {len(self.bad) - NAMED} more" if len(self.bad) > NAMED else ""
            text += f", {len(self.bad)} bad (" + named + more + ")"
        if self.bad_offset is not None:
            text += f"; stopped at byte {self.bad_offset}: {self.reason}"
        return printable(text, limit=1 << 20)


# One agent batch found in a spool: (seq, file index, body offset in the file,
# body length, the sender's identity, the relay's node identity, the relay's sender
# (None for spools that do not name it), the rbatch seq, the offset of its record).
# Identity dicts are shared between entries through the validator's identity cache.
Entry = tuple[int, int, int, int, dict[str, Any], dict[str, Any], str | None, int, int]


@dataclass
class SpoolIndex:
    by_sender: dict[str, list[Entry]] = field(default_factory=dict)
    relay_stats: dict[str, tuple[int, dict[str, int]]] = field(default_factory=dict)  # relay -> (rbatch seq, stats)
    dropped_upto: dict[str, int] = field(default_factory=dict)  # relay -> highest rbatch seq its spool cap dropped
    identities: messages.IdentityCache = field(default_factory=dict)


def parse_rbatch(record: bytes) -> tuple[dict[str, Any], list[tuple[int, int]]]:
    """Validate one packed rbatch without copying its item bodies.

    Returns the message with every item body replaced by ``b""``, and each body's
    (offset, length) inside ``record``, in item order. Raises ProtocolError for
    anything the live path would refuse.
    """
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(record), 1024))
    unpacker.feed(record)
    message: dict[Any, Any] = {}
    spans: list[tuple[int, int]] = []
    try:
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key != "items":
                message[key] = unpacker.unpack()
                continue
            items: list[list[Any]] = []
            for _ in range(unpacker.read_array_header()):
                item: list[Any] = []
                for position in range(unpacker.read_array_header()):
                    start = unpacker.tell()
                    header = _BIN_HEADER.get(record[start]) if position == 2 else None
                    if header is None:
                        item.append(unpacker.unpack())  # validation refuses whatever is not a body
                        continue
                    unpacker.skip()
                    spans.append((start + header, unpacker.tell() - start - header))
                    item.append(b"")
                items.append(item)
            message["items"] = items
        if unpacker.tell() != len(record):
            raise ProtocolError("trailing bytes after the rbatch")
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"record is not a packed map: {exc.__class__.__name__}") from None
    if not isinstance(message.get("t"), str):
        raise ProtocolError("message has no string type field 't'")
    return message, spans


def index_file(path: str, number: int, index: SpoolIndex, report: SpoolReport) -> None:
    """Pass 1 for one file: every valid rbatch's items into ``index`` (bodies stay on disk)."""
    with open(path, "rb") as fh:
        reader = spool.RecordReader(fh)
        for body_offset, record in reader:
            report.records += 1
            at = body_offset - _RECORD_HEADER  # where the record starts
            try:
                message, spans = parse_rbatch(record)
                if message["t"] != messages.RELAY_BATCH:
                    raise ProtocolError(f"not an rbatch: {message['t']!r}")
                message = messages.validate_client_message(message, index.identities)
            except Exception as exc:  # ProtocolError, or whatever else a corrupt record raises
                report.invalid_records += 1
                report.bad.append((at, str(exc) if isinstance(exc, ProtocolError) else f"{type(exc).__name__}: {exc}"))
                continue
            report.rbatches += 1
            peers, node, relay, rseq = message["peers"], message["node"], message["sender"], message["seq"]
            for (sender, seq, _), (offset, length) in zip(message["items"], spans, strict=True):
                identity = peers.get(sender) or _NO_IDENTITY
                entry = (seq, number, body_offset + offset, length, identity, node, relay, rseq, at)
                index.by_sender.setdefault(sender, []).append(entry)
            refused = clean_stats(message["stats"])[1]
            if refused:
                report.bad.append((at, f"{refused} relay counters refused (bad name or value, or beyond the cap)"))
            if relay is None:
                continue
            if message["spool_dropped_upto"] > index.dropped_upto.get(relay, 0):
                index.dropped_upto[relay] = message["spool_dropped_upto"]
            if message["stats"]:
                seen = index.relay_stats.get(relay)
                if seen is None or rseq >= seen[0]:
                    index.relay_stats[relay] = (rseq, message["stats"])
        report.bad_offset, report.reason = reader.bad_offset, reader.reason


class _Bodies:
    """Reads item bodies back by offset, keeping at most MAX_OPEN_FILES files open."""

    def __init__(self, paths: list[str]) -> None:
        self._paths = paths
        self._open: OrderedDict[int, int] = OrderedDict()  # file index -> fd, least recent first

    def read(self, number: int, offset: int, length: int) -> bytes:
        fd = self._open.get(number)
        if fd is None:
            if len(self._open) >= MAX_OPEN_FILES:
                os.close(self._open.popitem(last=False)[1])
            fd = self._open[number] = os.open(self._paths[number], os.O_RDONLY)
        else:
            self._open.move_to_end(number)
        data = os.pread(fd, length, offset)
        if len(data) != length:
            raise OSError(f"{self._paths[number]} changed while it was being ingested")
        return data

    def close(self) -> None:
        for fd in self._open.values():
            os.close(fd)
        self._open.clear()


def _in_order(index: SpoolIndex) -> Iterator[tuple[str, Entry]]:
    """Every item, each sender's in seq order (repeats of one seq side by side), the
    senders interleaved by file position: files given in order are read front to back."""
    lanes: list[Iterator[Entry]] = []
    heap: list[tuple[int, int, int, str, Entry]] = []
    for lane, (sender, entries) in enumerate(index.by_sender.items()):
        entries.sort(key=lambda e: (e[0], e[1], e[2]))
        lanes.append(iter(entries))
        first = next(lanes[lane])
        heap.append((first[1], first[2], lane, sender, first))
    heapq.heapify(heap)
    while heap:
        _, _, lane, sender, entry = heapq.heappop(heap)
        yield sender, entry
        following = next(lanes[lane], None)
        if following is not None:
            heapq.heappush(heap, (following[1], following[2], lane, sender, following))


class _Transaction:
    """Work items for one write; the rows it stores all come from one file (per-file report)."""

    def __init__(self) -> None:
        self.work: list[WorkItem] = []
        self.file: int | None = None  # the file of every new (non-duplicate) item in it
        self.bytes = 0
        self.records: dict[tuple[str, int], int] = {}  # (sender, seq) -> offset of its record

    def add(
        self, sender: str, seq: int, body: bytes, identity: dict[str, Any], node: dict[str, Any], record: int = 0
    ) -> None:
        self.records[(sender, seq)] = record
        last = self.work[-1] if self.work else None
        # One work item holds many senders' batches as long as they share the node and
        # each sender keeps the identity it had there.
        if last is None or last.node is not node or last.peers.get(sender, identity) is not identity:
            last = WorkItem("spool", None, len(self.work) + 1, [], {}, node, {})
            self.work.append(last)
        last.items.append([sender, seq, body])
        last.peers[sender] = identity
        self.bytes += len(body)


async def _write(writer: StoreWriter, txn: _Transaction, reports: list[SpoolReport], db_path: str) -> None:
    if not txn.work:
        return
    before = writer.counters.rows_stored
    set_aside: list[Quarantined] = []
    writer.on_quarantine = set_aside.extend
    try:
        ok = await writer.write_staged(writer.stage(txn.work))
    finally:
        writer.on_quarantine = None
    if not ok:
        raise OSError(f"writing {db_path} failed")
    if txn.file is not None:
        report = reports[txn.file]
        report.rows_stored += writer.counters.rows_stored - before
        for entry in set_aside:
            record = txn.records.get((entry.sender, entry.seq)) if isinstance(entry.sender, str) else None
            report.bad.append((-1 if record is None else record, f"batch set aside: {entry.reason}"))


async def ingest_spools(paths: list[str], db_path: str) -> list[SpoolReport]:
    writer = StoreWriter(db_path)
    await writer.open()
    reports = [SpoolReport(path) for path in paths]
    index = SpoolIndex()
    bodies = _Bodies(paths)
    try:
        for number, path in enumerate(paths):
            try:
                index_file(path, number, index, reports[number])
            except OSError as exc:
                reports[number].bad_offset, reports[number].reason = 0, f"cannot read: {exc.strerror or exc}"
        # The database's own marks first (an earlier ingest, or the live run).
        high = {sender: writer.ingestor.last_seq(sender) for sender in index.by_sender}
        txn = _Transaction()
        for sender, (seq, number, offset, length, identity, node, relay, rseq, at) in _in_order(index):
            if relay is not None and rseq <= index.dropped_upto.get(relay, 0):
                # Counted as lost by its relay (and reported so): storing it would count it twice.
                reports[number].relay_dropped += 1
                continue
            if seq <= high[sender]:
                # The writer discards it (and counts it) before reading the body, as the
                # live path does; its bytes need not be read at all.
                reports[number].duplicates_discarded += 1
                txn.add(sender, seq, b"", identity, node, at)
                continue
            high[sender] = seq
            if txn.bytes >= TXN_BYTES or (txn.file is not None and txn.file != number):
                await _write(writer, txn, reports, db_path)
                txn = _Transaction()
            txn.file = number
            txn.add(sender, seq, bodies.read(number, offset, length), identity, node, at)
        await _write(writer, txn, reports, db_path)
        # Relay counters last, in one transaction of their own (items-less rbatches).
        stats = [
            WorkItem(relay, None, seq, [], {}, {}, counters) for relay, (seq, counters) in index.relay_stats.items()
        ]
        if stats and not await writer.write(stats):
            raise OSError(f"writing {db_path} failed")
    finally:
        bodies.close()
        await writer.close()
    return reports
