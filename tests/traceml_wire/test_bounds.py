"""The bounds of what a peer states outside table cells, and their checks."""

from __future__ import annotations

from typing import Any

import pytest

from traceml_wire.bounds import (
    INT64_MAX,
    INT64_MIN,
    MAX_SENDER_CHARS,
    MAX_SEQ_JUMP,
    MAX_STATS_KEY_CHARS,
    MAX_STATS_KEYS,
    clean_stats,
    counter_ok,
    is_int64,
    saturate,
    sender_problem,
    seq_jump_problem,
    seq_problem,
)


def test_int64_and_saturation() -> None:
    assert is_int64(INT64_MAX) and is_int64(INT64_MIN) and is_int64(0)
    assert not is_int64(INT64_MAX + 1) and not is_int64(INT64_MIN - 1) and not is_int64(True) and not is_int64(1.0)
    assert [saturate(v) for v in (2**64, INT64_MAX, -5, INT64_MIN, -(2**70))] == [INT64_MAX, INT64_MAX, -5,
                                                                                 INT64_MIN, INT64_MIN]


@pytest.mark.parametrize("sender", ["", None, 7, b"bytes", "x" * (MAX_SENDER_CHARS + 1)])
def test_senders_refused(sender: Any) -> None:
    assert sender_problem(sender) is not None


def test_senders_accepted() -> None:
    assert sender_problem("s1/a0/n0/r0/1-ab") is None and sender_problem("x" * MAX_SENDER_CHARS) is None


@pytest.mark.parametrize("seq", [0, -1, INT64_MAX + 1, 2**64 - 1, True, 1.0, "1", None])
def test_seqs_refused(seq: Any) -> None:
    assert seq_problem(seq) == "seq outside 1..2**63-1"


def test_seqs_accepted_and_jumps() -> None:
    assert seq_problem(1) is None and seq_problem(INT64_MAX) is None
    assert seq_jump_problem(1 + MAX_SEQ_JUMP, 1) is None
    assert seq_jump_problem(2 + MAX_SEQ_JUMP, 1) == (
        f"seq {2 + MAX_SEQ_JUMP} jumps more than {MAX_SEQ_JUMP} past the sender's last seq 1"
    )
    assert seq_jump_problem(1, 10**9) is None  # at or below the mark: a duplicate, not a jump


def test_counters() -> None:
    assert counter_ok("dropped_batches", 0) and counter_ok("x" * MAX_STATS_KEY_CHARS, INT64_MAX)
    for name, value in [("", 1), ("x" * (MAX_STATS_KEY_CHARS + 1), 1), (3, 1), ("a", -1), ("a", INT64_MAX + 1),
                        ("a", True), ("a", 1.5), ("a", None)]:
        assert not counter_ok(name, value), (name, value)


def test_clean_stats_keeps_the_first_valid_entries_up_to_the_cap() -> None:
    stats: dict[Any, Any] = {"bad": 2**64 - 1, "dropped_batches": 3, 5: 1}
    stats |= {f"k{i}": i for i in range(MAX_STATS_KEYS + 10)}
    kept, refused = clean_stats(stats)
    assert kept == {"dropped_batches": 3, **{f"k{i}": i for i in range(MAX_STATS_KEYS - 1)}}
    assert refused == len(stats) - MAX_STATS_KEYS
    assert clean_stats([("a", 1)]) == ({}, 0)
