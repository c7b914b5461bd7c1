"""Batches set aside: what cannot be stored is kept raw, named and counted, never retried.

Two things put a batch here, and either way it is acknowledged and the daemon
goes on with the next one:

* decoding (``ingest/decode.py``): an agent item whose sender, seq or body
  fails its checks (``traceml_wire/bounds.py``, ``traceml_wire/tables.py``);
* a transaction that failed for its data (``is_data_error``): the writer rolls
  it back and writes its work items one at a time, then the parts of one that
  fails alone (its relay counters, each agent item); a part that fails alone
  too is set aside (``ingest/pipeline.py``).

A row holds the relay, the agent sender and the seq as short text, the reason,
and the batch's bytes cut to ``BODY_BYTES``: nothing in it can fail to store for
the data it describes. The table is bounded: the newest ``ROWS_KEPT`` rows, of
which the newest ``BODIES_KEPT`` keep their bytes; the ``batches_quarantined``
counter keeps the full count.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from typing import Any

from traceml_daemon.store.statements import SqlParts, Statement, multi_row_tuples
from traceml_wire.printable import printable

BODY_BYTES = 64 * 1024  # bytes kept of one batch
BODIES_KEPT = 256  # newest rows that keep their bytes
ROWS_KEPT = 10_000  # newest rows kept at all
TEXT_CHARS = 300  # longest relay, sender or reason text kept

_INSERT: SqlParts = ("INSERT INTO quarantine (ts, relay, sender, seq, reason, body, body_bytes)", "", 7)


@dataclass(frozen=True, slots=True)
class Quarantined:
    """One batch set aside: ``sender`` and ``seq`` as they came (any type)."""

    relay: str
    sender: Any
    seq: Any
    reason: str
    body: bytes | None


def _text(value: Any) -> str | None:
    """``value`` as short text that SQLite always stores (valid UTF-8, bounded)."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value if len(value) <= TEXT_CHARS else f"{value[:TEXT_CHARS]}... ({len(value)} characters)"
    elif type(value) is int:
        # Python refuses to print an int of thousands of digits: say how wide it is.
        text = str(value) if value.bit_length() <= 128 else f"an int of {value.bit_length()} bits"
    else:
        text = f"a {type(value).__name__}"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def describe(entries: list[Quarantined]) -> str:
    """One log line's worth: how many, and the first one."""
    first = entries[0]
    return printable(
        f"{len(entries)} batch{'es' if len(entries) > 1 else ''} (first: {_text(first.sender)} seq "
        f"{_text(first.seq)} from {_text(first.relay)}: {_text(first.reason)})",
        limit=1024,
    )


def row(entry: Quarantined, now: float) -> tuple[Any, ...]:
    body = entry.body if isinstance(entry.body, bytes) else None
    return (
        now,
        _text(entry.relay),
        _text(entry.sender),
        _text(entry.seq),
        _text(entry.reason) or "unknown",
        None if body is None else body[:BODY_BYTES],
        0 if body is None else len(body),
    )


def statements(entries: list[Quarantined], now: float) -> list[Statement]:
    """Insert ``entries`` and keep the table within its bounds (rowid ranges, no scan:
    the rows that fall out of each bound now are the last ``len(entries)`` before it)."""
    n = len(entries)
    return [
        *multi_row_tuples(_INSERT, [row(entry, now) for entry in entries]),
        ("DELETE FROM quarantine WHERE id <= (SELECT max(id) FROM quarantine) - ?", (ROWS_KEPT,)),
        (
            "UPDATE quarantine SET body = NULL WHERE id > (SELECT max(id) FROM quarantine) - ? "
            "AND id <= (SELECT max(id) FROM quarantine) - ?",
            (BODIES_KEPT + n, BODIES_KEPT),
        ),
    ]


def is_data_error(exc: BaseException) -> bool:
    """Whether a failed write failed for what it wrote (the same rows would fail again:
    set them aside) rather than for the database or the machine (disk full, I/O,
    locked, corrupt: the senders resend and a later write may succeed)."""
    if isinstance(exc, (sqlite3.OperationalError, OSError, MemoryError)):
        return False
    if type(exc) in (sqlite3.DatabaseError, sqlite3.InternalError):
        return False  # a corrupt file or SQLite's own failure
    return isinstance(exc, Exception)


def reason_of(exc: BaseException | None) -> str:
    """Why a batch that failed alone was set aside."""
    return "write failed alone" if exc is None else f"write failed alone: {type(exc).__name__}: {exc}"
