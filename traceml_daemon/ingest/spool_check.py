"""Is a relay spool whole: every record's length and CRC, and what each record holds.

A record (``traceml_wire/spool.py``) must be intact (its CRC holds), a valid
``rbatch`` (what the live daemon would accept), with rbatch seqs rising
through the file (the relay spills its oldest batches in order), every item's
agent seq rising per sender, and every item body decoding as tables whose
columns have the wire's types. The first record that fails is named by file
and byte offset; ``traceml-daemon ingest`` would store everything before it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from traceml_daemon.commands.ingest import parse_rbatch
from traceml_wire import messages, spool
from traceml_wire.errors import ProtocolError
from traceml_wire.tables import decode_batch

_RECORD_HEADER = 8  # length and CRC before each record's body (traceml_wire/spool.py)
SPOOL_SUFFIX = ".trs"


class SpoolUnreadable(Exception):
    """No such file or directory, or it cannot be read."""


@dataclass
class SpoolFileReport:
    path: str
    records: int = 0
    items: int = 0
    bad_offset: int | None = None  # start of the first bad record
    reason: str = ""


@dataclass
class SpoolReport:
    files: list[SpoolFileReport] = field(default_factory=list)

    @property
    def first_bad(self) -> SpoolFileReport | None:
        return next((f for f in self.files if f.bad_offset is not None), None)


def spool_files(target: str) -> list[str]:
    """The spool files of ``target``: the file itself, or a directory's ``*.trs`` files in name order."""
    p = Path(target)
    if p.is_file():
        return [str(p)]
    if not p.exists():
        raise SpoolUnreadable(f"{target}: no such file or directory")
    if not p.is_dir():
        raise SpoolUnreadable(f"{target}: not a file or directory")
    try:
        names = sorted(os.listdir(p))
    except OSError as exc:
        raise SpoolUnreadable(f"{target}: cannot list ({exc.strerror})") from None
    return [str(p / n) for n in names if n.endswith(SPOOL_SUFFIX) and (p / n).is_file()]


def check_file(path: str) -> SpoolFileReport:
    """Every record of one spool file, stopping at the first bad one."""
    report = SpoolFileReport(path)
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed below; the reader streams from it
    except OSError as exc:
        raise SpoolUnreadable(f"{path}: cannot read ({exc.strerror})") from None
    with fh:
        reader = spool.RecordReader(fh)
        last_rseq = 0
        agent_seq: dict[str, int] = {}
        for body_offset, record in reader:
            at = body_offset - _RECORD_HEADER
            problem = _record_problem(record, last_rseq, agent_seq)
            if isinstance(problem, str):
                report.bad_offset, report.reason = at, problem
                return report
            last_rseq, n_items = problem
            report.records += 1
            report.items += n_items
        if reader.bad_offset is not None:
            report.bad_offset, report.reason = reader.bad_offset, reader.reason
    return report


def _record_problem(record: bytes, last_rseq: int, agent_seq: dict[str, int]) -> tuple[int, int] | str:
    """(rbatch seq, items) of a sound record, else what is wrong with it."""
    try:
        message, spans = parse_rbatch(record)
        if message["t"] != messages.RELAY_BATCH:
            return f"not an rbatch: {message['t']!r}"
        message = messages.validate_client_message(message)
    except ProtocolError as exc:
        return f"not a valid rbatch: {exc}"
    except Exception as exc:  # a corrupt record can make msgpack raise anything
        return f"not a valid rbatch: {type(exc).__name__}: {exc}"
    rseq = message["seq"]
    if rseq <= last_rseq:
        return f"rbatch seq {rseq} does not follow {last_rseq}: records out of order"
    for (sender, seq, _), (offset, length) in zip(message["items"], spans, strict=True):
        if seq <= agent_seq.get(sender, 0):
            return f"agent seq {seq} of {sender!r} does not follow {agent_seq[sender]}"
        agent_seq[sender] = seq
        try:
            decode_batch(record[offset : offset + length])
        except ProtocolError as exc:
            return f"item {sender!r} seq {seq}: body does not decode: {exc}"
    return rseq, len(message["items"])


def validate_spool(target: str) -> SpoolReport:
    """Check every spool file of ``target``; stops after the first file with a bad record."""
    report = SpoolReport()
    for path in spool_files(target):
        file_report = check_file(path)
        report.files.append(file_report)
        if file_report.bad_offset is not None:
            break
    return report
