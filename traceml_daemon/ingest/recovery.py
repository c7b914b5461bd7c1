"""After a failed transaction: its work written apart, and what fails alone set aside.

A transaction holds many relays' batches; one bad value among them (an
integer SQLite refuses, a constraint, a bug its data triggers) fails the whole
of it, and retrying it whole would fail again, for ever. So when a transaction
fails for its data (``quarantine.is_data_error``) the writer rolls it back and
calls ``write_apart``: every work item in its own transaction, and for one that
fails alone its parts (the relay's counters, each agent item), each alone; a
part that fails alone too is set aside in ``quarantine`` with the reason. The
rest is stored, and every work item is acknowledged: stored or set aside, it
is never resent into the same failure.

A failure that is not the data's (disk full, I/O, a locked or corrupt file)
stops it: what is not written by then is not acknowledged, and its relays
resend it later, as after any failed write. None of this runs on the happy
path: it starts only once a transaction has failed.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import msgpack

from traceml_daemon.ingest.quarantine import Quarantined, reason_of
from traceml_daemon.ingest.staging import WorkItem


class Outcome(enum.Enum):
    STORED = "stored"  # committed (rows, or the batch set aside)
    DATA = "data"  # failed for what it wrote: would fail again
    OTHER = "other"  # failed for the database or the machine: may succeed later


# Writes ``work`` (staged alone) and sets aside ``entries``, in one transaction.
WriteAlone = Callable[[list[WorkItem], list[Quarantined]], Awaitable[tuple[Outcome, BaseException | None]]]


def parts(work: WorkItem) -> list[WorkItem]:
    """``work`` as the parts it is written in apart: its relay counters, then each agent
    item with the identities it needs; no callbacks (the whole is acknowledged)."""
    out: list[WorkItem] = []
    if work.stats:
        out.append(replace(work, items=[], done=None, live=None))
    for item in work.items:
        out.append(replace(work, items=[item], stats={}, done=None, live=None))
    return out


def _packed(value: Any) -> bytes | None:
    try:
        return msgpack.packb(value)
    except Exception:  # whatever it holds, the reason still says what happened
        return None


def entry_of(part: WorkItem, reason: str) -> Quarantined:
    """``part`` set aside whole: an agent item's body as sent, else what it held, packed."""
    items = part.items
    if len(items) == 1 and isinstance(items[0], (list, tuple)) and len(items[0]) == 3:
        sender, seq, body = items[0]
        return Quarantined(part.relay_sender, sender, seq, reason, body if isinstance(body, bytes) else None)
    return Quarantined(part.relay_sender, None, part.seq, reason, _packed({"items": items, "stats": part.stats}))


async def _set_aside(write: WriteAlone, part: WorkItem, failure: BaseException | None) -> Outcome:
    outcome, _ = await write([], [entry_of(part, reason_of(failure))])
    # Setting a batch aside stores bytes and short text only: if even that fails, the
    # database is at fault, and the batch is left to be resent.
    return Outcome.STORED if outcome is Outcome.STORED else Outcome.OTHER


async def _apart(write: WriteAlone, work: WorkItem, failure: BaseException | None) -> Outcome:
    """``work``, which failed alone: each part alone, setting aside what fails."""
    pieces = parts(work)
    if len(pieces) <= 1:
        return await _set_aside(write, work, failure)
    for piece in pieces:
        outcome, exc = await write([piece], [])
        if outcome is Outcome.DATA:
            outcome = await _set_aside(write, piece, exc)
        if outcome is not Outcome.STORED:
            return outcome
    return Outcome.STORED


async def write_apart(work: list[WorkItem], write: WriteAlone, whole_first: bool) -> tuple[list[bool], bool]:
    """Write ``work`` after its transaction failed: one work item at a time, the parts
    of one that fails alone each alone (``whole_first``: try it all in one transaction
    first, for work that was only queued behind the failure). Returns, per work item,
    whether to acknowledge it (stored or set aside), and whether all of it was settled
    so (False: a failure that is not the data's stopped it)."""
    acks = [False] * len(work)
    # Batches of a connection that failed meanwhile are resent by their relay: not written.
    todo = [i for i, item in enumerate(work) if item.live is None or item.live()]
    if whole_first and len(todo) > 1:
        outcome, _ = await write([work[i] for i in todo], [])
        if outcome is Outcome.STORED:
            for i in todo:
                acks[i] = True
            return acks, len(todo) == len(work)
        if outcome is Outcome.OTHER:
            return acks, False
    for i in todo:
        outcome, exc = await write([work[i]], [])
        if outcome is Outcome.DATA:
            outcome = await _apart(write, work[i], exc)
        if outcome is not Outcome.STORED:
            return acks, False
        acks[i] = True
    return acks, len(todo) == len(work)
