"""History partials: an agent's fine buckets equal a naive fold of its steps, travel in
the body, and the daemon's check refuses anything that could not merge safely or
does not account for exactly the batch's steps."""

from __future__ import annotations

import copy
import random
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from traceml_wire.body import encode_body
from traceml_wire.bounds import INT64_MAX, MAX_DURATION_NS
from traceml_wire.errors import ProtocolError
from traceml_wire.partials import (
    COLUMNS,
    FINE_STEPS,
    METRIC_COLUMNS,
    PARTIAL_COLUMNS,
    PARTIALS_MIN_STEPS,
    decode_partials,
    encode_partials,
    fine_stats,
)
from traceml_wire.tables import decode_batch


def _steps(steps: list[int | None], seed: int = 1, none_share: float = 0.1) -> dict[str, list[Any]]:
    rng = random.Random(seed)
    cols: dict[str, list[Any]] = {"step": list(steps), "ts": [1_700_000_000.0 + i for i in range(len(steps))]}
    for name in METRIC_COLUMNS:
        cols[name] = [None if rng.random() < none_share else rng.randint(0, 10**9) for _ in steps]
    cols["h2d_ns"] = [None] * len(steps)  # a phase not measured at all (CPU jobs)
    return cols


def _naive(cols: dict[str, list[Any]]) -> dict[int, list[Any]]:
    """Bucket -> Stats, one row at a time."""
    out: dict[int, list[Any]] = {}
    for i, step in enumerate(cols["step"]):
        if step is None:
            continue
        acc = out.setdefault(step // FINE_STEPS, [0, None, None, None] + [0, None, None, 0] * len(METRIC_COLUMNS))
        acc[0] += 1
        acc[1] = step if acc[1] is None else min(acc[1], step)
        acc[2] = step if acc[2] is None else max(acc[2], step)
        acc[3] = cols["ts"][i] if acc[3] is None else max(acc[3], cols["ts"][i])
        for j, name in enumerate(METRIC_COLUMNS):
            v = cols[name][i]
            if v is None:
                continue
            at = 4 + 4 * j
            acc[at] += 1
            acc[at + 1] = v if acc[at + 1] is None else min(acc[at + 1], v)
            acc[at + 2] = v if acc[at + 2] is None else max(acc[at + 2], v)
            acc[at + 3] += v
    return out


def _as_buckets(partials: dict[str, Any]) -> dict[int, list[Any]]:
    cols = partials["cols"]
    return {row[0]: list(row[1:]) for row in zip(*(cols[name] for name in PARTIAL_COLUMNS), strict=True)}


@pytest.mark.parametrize("order", ["ascending", "shuffled", "gaps and unnumbered"])
def test_partials_equal_a_naive_fold(order: str) -> None:
    steps: list[int | None] = list(range(37, 37 + 1000))
    if order == "shuffled":
        random.Random(3).shuffle(steps)
    elif order == "gaps and unnumbered":
        steps = [None if s % 97 == 0 else s * 3 for s in steps]
    cols = _steps(steps)
    partials = encode_partials(cols)
    assert partials is not None and partials["level"] == FINE_STEPS
    assert _as_buckets(partials) == _naive(cols)


def test_small_batches_and_unreadable_steps_carry_no_partials() -> None:
    assert encode_partials(_steps(list(range(PARTIALS_MIN_STEPS - 1)))) is None
    assert encode_partials(_steps(list(range(PARTIALS_MIN_STEPS)))) is not None
    missing = _steps(list(range(200)))
    del missing["wait_ns"]
    assert encode_partials(missing) is None
    odd = _steps(list(range(200)))
    odd["step_ns"][5] = "fast"  # never raised into the agent: the rows go unfolded
    assert encode_partials(odd) is None
    ragged = _steps(list(range(200)))
    ragged["ts"].pop()
    assert encode_partials(ragged) is None


def test_a_body_carries_its_steps_partials_and_they_pass_the_check() -> None:
    cols = _steps(list(range(10, 300)))
    tables, raw = decode_batch(encode_body({"steps": cols}, sent_ts=1.0))
    step_col = tables["steps"][0]
    fine = decode_partials(raw, step_col)
    assert dict(fine) == _naive(cols)
    assert decode_batch(encode_body({"steps": _steps(list(range(10)))}))[1] is None


def _valid() -> tuple[dict[str, Any], list[int]]:
    steps = list(range(50, 250))
    return copy.deepcopy(encode_partials(_steps(steps, none_share=0.0))), steps  # type: ignore[return-value]


def _set(partials: dict[str, Any], column: str, row: int, value: Any) -> dict[str, Any]:
    partials["cols"][column][row] = value
    return partials


TAMPERED = {
    "wrong level": lambda p: {**p, "level": 128},
    "not a map": lambda p: [p],
    "no cols": lambda p: {"level": FINE_STEPS},
    "a column missing": lambda p: {**p, "cols": {k: v for k, v in p["cols"].items() if k != "wait_max"}},
    "ragged": lambda p: {**p, "cols": {**p["cols"], "n": p["cols"]["n"][:-1]}},
    "a repeated bucket": lambda p: _set(p, "bucket", 1, p["cols"]["bucket"][0]),
    "a step outside its bucket": lambda p: _set(p, "last_step", 0, p["cols"]["last_step"][0] + FINE_STEPS),
    "first after last": lambda p: _set(p, "first_step", 1, p["cols"]["last_step"][1] + 1),
    "a bucket of no steps": lambda p: _set(p, "n", 0, 0),
    "more steps than the batch": lambda p: _set(p, "n", 0, p["cols"]["n"][0] + 1),
    "a count above n": lambda p: _set(p, "forward_n", 0, p["cols"]["n"][0] + 1),
    "min above max": lambda p: _set(p, "forward_min", 0, p["cols"]["forward_max"][0] + 1),
    "a sum below n * min": lambda p: _set(p, "step_sum", 0, 0),
    "a float figure": lambda p: _set(p, "backward_max", 0, 1.5),
    "a bool count": lambda p: _set(p, "n", 0, True),
    "beyond int64": lambda p: _set(p, "step_max", 0, 2**64),
    # Longer than a duration the daemon stores (it would store the cell as NULL).
    "a duration beyond the stored maximum": lambda p: _set(p, "step_max", 0, MAX_DURATION_NS + 1),
    "a duration below minus the maximum": lambda p: _set(p, "step_min", 0, -MAX_DURATION_NS - 1),
    "figures for nothing": lambda p: _set(p, "dataloader_n", 0, 0),
    "a text last_ts": lambda p: _set(p, "last_ts", 0, "now"),
}


@pytest.mark.parametrize("what", list(TAMPERED))
def test_tampered_partials_are_refused_with_the_reason(what: str) -> None:
    partials, steps = _valid()
    assert decode_partials(partials, steps)  # the untampered one passes
    with pytest.raises(ProtocolError, match="history partials"):
        decode_partials(TAMPERED[what](partials), steps)


def test_partials_must_account_for_exactly_the_batch_steps() -> None:
    partials, steps = _valid()
    with pytest.raises(ProtocolError, match="count 200 steps, the batch has 199"):
        decode_partials(partials, steps[:-1])
    with pytest.raises(ProtocolError, match="the batch has 0"):
        decode_partials(partials, ())
    assert decode_partials(partials, [*steps, None])  # an unnumbered step is in no bucket


_packable_ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)  # what msgpack can carry
_cells = st.one_of(
    st.none(), st.booleans(), _packable_ints, st.floats(allow_nan=True),
    st.text(max_size=3), st.binary(max_size=3), st.lists(_packable_ints, max_size=2),
)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_decode_partials_raises_only_protocol_error(data: st.DataObject) -> None:
    partials, steps = _valid()
    cols = partials["cols"]
    for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
        column = data.draw(st.sampled_from([*PARTIAL_COLUMNS, "level", "cols"]))
        if column in ("level", "cols"):
            partials[column] = data.draw(_cells)
            break
        row = data.draw(st.integers(min_value=0, max_value=len(cols[column]) - 1))
        cols[column][row] = data.draw(_cells)
    raw = msgpack.unpackb(msgpack.packb(partials, use_bin_type=True), raw=False, strict_map_key=False, use_list=False)
    try:
        fine = decode_partials(raw, tuple(steps))
    except ProtocolError:
        return
    # Whatever passed merges safely: every figure an int64 (or None where nothing counted).
    for bucket, stats in fine:
        assert type(bucket) is int and stats[0] >= 1


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.none(), st.integers(min_value=0, max_value=5000)), min_size=PARTIALS_MIN_STEPS, max_size=400))
def test_any_steps_agents_send_pass_the_daemon_check(steps: list[int | None]) -> None:
    cols = _steps(steps, seed=len(steps))
    partials = encode_partials(cols)
    if all(s is None for s in steps):
        assert partials is None
        return
    assert partials is not None
    assert dict(decode_partials(partials, steps)) == _naive(cols)
    assert list(COLUMNS) == ["step", "ts", *METRIC_COLUMNS]


def test_a_buckets_sums_saturate_at_the_int64_bounds() -> None:
    """Cells an older daemon stored before durations were bounded, folded on catch-up:
    a sum beyond int64 is pinned at its bound (SQLite stores nothing wider), with or
    without unmeasured cells among them."""
    n = FINE_STEPS
    cols = {"step": list(range(n)), "ts": [1.0] * n, "step_ns": [2**62] * n,
            **{name: [-(2**62)] * n for name in METRIC_COLUMNS[1:]}}
    cols["wait_ns"] = [None, *[2**62] * (n - 1)]
    ((bucket, stats),) = fine_stats([cols[name] for name in COLUMNS])
    sums = {name: stats[4 + 4 * i + 3] for i, name in enumerate(METRIC_COLUMNS)}
    assert sums == {"step_ns": INT64_MAX, "wait_ns": INT64_MAX,
                    **{name: -(2**63) for name in METRIC_COLUMNS[1:-1]}}
