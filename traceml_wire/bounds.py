"""Bounds on what a peer states outside table cells, and their checks (pure).

SQLite stores signed 64-bit integers; msgpack carries integers up to 2**64 - 1,
and the sqlite3 module refuses anything wider at bind time (OverflowError), in
the middle of a transaction. Table cells are checked by ``traceml_wire.tables``
and identity fields by ``traceml_wire.identity``; this module holds the bounds
of everything else a relay states in an rbatch (its counters, the agent
senders and seqs of its items) and the ceiling of a stored duration, each with
a small check. The daemon calls them where it decodes an rbatch's contents
(``traceml_daemon/ingest/decode.py``), before anything reaches SQLite.

Each check returns the reason a value is refused (None: accepted), so the
caller can set the item aside with it.
"""

from __future__ import annotations

from typing import Any

INT64_MAX = 2**63 - 1  # SQLite's INTEGER is a signed 64-bit int
INT64_MIN = -(2**63)

# An agent sender id: hellos allow 200 characters; some room above that for
# relays that built ids of their own, none for megabytes.
MAX_SENDER_CHARS = 256
# Distinct agent senders in one rbatch: a relay serves one node, whose ranks
# are a few dozen; items of further senders are set aside. Below the frame's cap
# on items (traceml_wire/framing.py), which many batches of few senders fill.
MAX_SENDERS_PER_RBATCH = 1024
# A relay's counters (``stats``): a handful of names in practice.
MAX_STATS_KEYS = 64
MAX_STATS_KEY_CHARS = 64
# How far an item's seq may run ahead of its sender's high-water mark: agents
# number their batches one by one, so a larger jump is a forged or corrupted
# seq, which would make every later batch of that sender look like a duplicate.
MAX_SEQ_JUMP = 2**20
# The longest step or phase duration stored: the largest integer a double holds
# exactly (about 104 days), far above any real step. Longer cells are stored as
# NULL (not measured); a bucket's sums still saturate (many long steps add up).
MAX_DURATION_NS = 2**53


def is_int64(value: Any) -> bool:
    """An int (not a bool) that SQLite stores as it is."""
    return type(value) is int and INT64_MIN <= value <= INT64_MAX


def saturate(value: int) -> int:
    """``value`` clamped to the int64 range: sums of many stored figures stay storable."""
    return INT64_MAX if value > INT64_MAX else INT64_MIN if value < INT64_MIN else value


def sender_problem(sender: Any) -> str | None:
    """Why an item's agent sender cannot be stored, or None."""
    if type(sender) is not str or not sender:
        return "sender is not a non-empty string"
    if len(sender) > MAX_SENDER_CHARS:
        return f"sender of {len(sender)} characters (at most {MAX_SENDER_CHARS})"
    return None


def seq_problem(seq: Any) -> str | None:
    """Why an item's seq cannot be stored, or None."""
    if type(seq) is not int or not 1 <= seq <= INT64_MAX:
        return "seq outside 1..2**63-1"
    return None


def seq_jump_problem(seq: int, mark: int) -> str | None:
    """Why ``seq`` may not follow the sender's high-water ``mark``, or None (a seq at
    or below it is a duplicate, which is not a problem)."""
    if seq - mark > MAX_SEQ_JUMP:
        return f"seq {seq} jumps more than {MAX_SEQ_JUMP} past the sender's last seq {mark}"
    return None


def counter_ok(name: Any, value: Any) -> bool:
    """Whether one cumulative counter (a relay's stats entry, an agent's drop counter)
    may be stored: a short name and a count in 0..int64."""
    return (
        type(name) is str
        and 0 < len(name) <= MAX_STATS_KEY_CHARS
        and type(value) is int
        and 0 <= value <= INT64_MAX
    )


def clean_stats(stats: Any) -> tuple[dict[str, int], int]:
    """A relay's ``stats`` as stored: valid entries (``counter_ok``), at most
    ``MAX_STATS_KEYS`` of them in the order sent; and how many were refused."""
    if not isinstance(stats, dict):
        return {}, 0
    kept: dict[str, int] = {}
    for name, value in stats.items():
        if len(kept) >= MAX_STATS_KEYS:
            break
        if counter_ok(name, value):
            kept[name] = value
    return kept, len(stats) - len(kept)
