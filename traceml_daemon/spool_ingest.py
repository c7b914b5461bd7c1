"""``traceml-daemon ingest``: load relay spool files into a database.

A spool record is a packed ``rbatch``, so replaying one goes through exactly
the live path (Ingestor + StoreWriter): the same dedup applies, and a spool
whose batches already arrived live adds nothing. A damaged spool is read up to
its first bad record; that offset is reported and the rest is skipped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from traceml_daemon.store.writer import StoreWriter, WorkItem
from traceml_wire import messages, spool
from traceml_wire.errors import ProtocolError
from traceml_wire.framing import unpack_message

TXN_BYTES = 32 * 1024 * 1024


@dataclass
class SpoolReport:
    path: str
    records: int = 0  # intact records read
    rbatches: int = 0  # records that held a valid rbatch
    invalid_records: int = 0  # intact records that were not a valid rbatch
    rows_stored: int = 0
    duplicates_discarded: int = 0
    bad_offset: int | None = None
    reason: str = ""

    def line(self) -> str:
        text = (
            f"{self.path}: {self.records} records, {self.rows_stored} rows stored, "
            f"{self.duplicates_discarded} duplicate batches discarded"
        )
        if self.invalid_records:
            text += f", {self.invalid_records} invalid records skipped"
        if self.bad_offset is not None:
            text += f"; stopped at byte {self.bad_offset}: {self.reason}"
        return text


def _work_items(path: str, report: SpoolReport) -> list[tuple[WorkItem, int]]:
    with open(path, "rb") as fh:
        data = fh.read()
    scan = spool.scan(data)
    report.records = len(scan.records)
    report.bad_offset, report.reason = scan.bad_offset, scan.reason
    out: list[tuple[WorkItem, int]] = []
    for body in scan.records:
        try:
            message = messages.validate_client_message(unpack_message(body))
        except ProtocolError:
            report.invalid_records += 1
            continue
        if message["t"] != messages.RELAY_BATCH:
            report.invalid_records += 1
            continue
        report.rbatches += 1
        out.append(
            (
                WorkItem(
                    # Relay stats in a spool are stale snapshots of counters the relay
                    # also reports live; storing them under another source would double count.
                    relay_sender=f"spool:{os.path.basename(path)}",
                    session=None,  # the agent sender ids carry their session
                    seq=message["seq"],
                    items=message["items"],
                    peers=message["peers"],
                    node=message["node"],
                    stats={},
                ),
                len(body),
            )
        )
    return out


async def ingest_spools(paths: list[str], db_path: str) -> list[SpoolReport]:
    writer = StoreWriter(db_path)
    await writer.open()
    reports: list[SpoolReport] = []
    try:
        for path in paths:
            report = SpoolReport(path)
            reports.append(report)
            try:
                items = _work_items(path, report)
            except OSError as exc:
                report.bad_offset, report.reason = 0, f"cannot read: {exc.strerror or exc}"
                continue
            rows_before = writer.counters.rows_stored
            dups_before = writer.counters.duplicates_discarded
            chunk: list[WorkItem] = []
            size = 0
            for item, nbytes in items:
                chunk.append(item)
                size += nbytes
                if size >= TXN_BYTES:
                    if not await writer.write(chunk):
                        raise OSError(f"writing {db_path} failed")
                    chunk, size = [], 0
            if chunk and not await writer.write(chunk):
                raise OSError(f"writing {db_path} failed")
            report.rows_stored = writer.counters.rows_stored - rows_before
            report.duplicates_discarded = writer.counters.duplicates_discarded - dups_before
    finally:
        await writer.close()
    return reports
