"""Columnar tables: encode/decode, type checks, additive evolution."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from traceml_wire import ProtocolError
from traceml_wire.body import encode_body
from traceml_wire.tables import TABLES, TableBuilder, columns, decode_body, rows


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def test_builder_round_trip_fills_missing_columns() -> None:
    b = TableBuilder("scalars")
    b.append({"step": 1, "name": "loss", "value": 0.5})
    b.append({"step": 2, "name": "loss"})
    assert len(b) == 2
    body = encode_body({"scalars": b.take()}, sent_ts=1.5)
    assert len(b) == 0
    out = decode_body(body)
    assert out == {"scalars": {"step": [1, 2], "name": ["loss", "loss"], "value": [0.5, None]}}
    assert msgpack.unpackb(body)["sent_ts"] == 1.5


def test_missing_known_columns_become_none() -> None:
    out = decode_body(_pack({"tables": {"steps": {"step": [1, 2], "step_ns": [10, 20]}}}))
    assert set(out["steps"]) == set(columns("steps"))
    assert out["steps"]["forward_ns"] == [None, None]
    assert rows(out["steps"], ("step", "step_ns")) == [(1, 10), (2, 20)]


def test_unknown_tables_and_columns_are_ignored() -> None:
    body = _pack({"tables": {"future": {"x": [1]}, "scalars": {"step": [1], "name": ["a"], "value": [1.0], "new": ["ragged", 1]}}, "extra": 1})
    assert decode_body(body) == {"scalars": {"step": [1], "name": ["a"], "value": [1.0]}}


def test_empty_tables_are_omitted() -> None:
    assert decode_body(encode_body({"steps": {}, "scalars": {"step": [], "name": [], "value": []}})) == {}
    assert decode_body(_pack({})) == {}


def test_int_accepted_for_real_columns() -> None:
    out = decode_body(_pack({"tables": {"scalars": {"step": [1], "name": ["a"], "value": [3]}}}))
    assert out["scalars"]["value"] == [3]


def test_ragged_columns_rejected() -> None:
    with pytest.raises(ProtocolError, match="different lengths"):
        decode_body(_pack({"tables": {"scalars": {"step": [1, 2], "name": ["a"]}}}))


@pytest.mark.parametrize(
    "col,values",
    [("step", [1.5]), ("step", ["1"]), ("value", ["x"]), ("name", [1]), ("name", [True]), ("name", [b"a"])],
)
def test_wrong_typed_columns_rejected(col: str, values: list[Any]) -> None:
    with pytest.raises(ProtocolError):
        decode_body(_pack({"tables": {"scalars": {col: values}}}))


@pytest.mark.parametrize(
    "body",
    [b"\xc1", _pack([1]), _pack({"tables": [1]}), _pack({"tables": {"scalars": [1]}}), _pack({"tables": {"scalars": {"step": 1}}})],
)
def test_malformed_bodies_rejected(body: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_body(body)


def test_every_table_has_unique_typed_columns() -> None:
    for name, spec in TABLES.items():
        names = [c for c, _ in spec]
        assert len(names) == len(set(names)), name
        assert {k for _, k in spec} <= {"int", "real", "text"}


_cell = st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=False) | st.text(max_size=3) | st.binary(max_size=3)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from([*TABLES, "unknown"]) | st.integers(0, 3),
        st.dictionaries(st.sampled_from(["step", "name", "value", "ts", "x"]), st.lists(_cell, max_size=3) | _cell, max_size=4)
        | _cell,
        max_size=3,
    )
)
def test_decode_raises_only_protocol_error(tables: dict[Any, Any]) -> None:
    try:
        out = decode_body(_pack({"tables": tables}))
    except ProtocolError:
        return
    for name, table in out.items():
        assert set(table) == set(columns(name))
        assert len({len(v) for v in table.values()}) == 1


def test_integers_beyond_int64_rejected() -> None:
    # SQLite stores signed 64-bit integers; sqlite3 refuses anything else at bind time,
    # which would fail the daemon's whole transaction, so decode refuses it first.
    for col, value in (("step", 2**63), ("step", 2**64 - 1), ("value", 2**63)):
        with pytest.raises(ProtocolError, match="64-bit"):
            decode_body(_pack({"tables": {"scalars": {col: [1, value] if col == "step" else [1.0, value]}}}))
    edge = decode_body(_pack({"tables": {"scalars": {"step": [2**63 - 1, -(2**63)], "value": [2**63 - 1, 0.5]}}}))
    assert edge["scalars"]["step"] == [2**63 - 1, -(2**63)]


def test_an_int_column_takes_ints_bools_and_none_and_refuses_the_rest() -> None:
    # A bool is the integer it is (Python's bool is an int; SQLite stores 0 and 1).
    ok = decode_body(_pack({"tables": {"scalars": {"step": [True, False, 7, None], "name": ["a"] * 4,
                                                   "value": [True, 0.5, 3, None]}}}))
    assert ok["scalars"]["step"] == [1, 0, 7, None]
    assert ok["scalars"]["value"] == [1, 0.5, 3, None]
    for bad, kind in ((1.5, "float"), ("7", "str"), (b"7", "bytes"), ([1], "tuple")):
        for cells in ([bad], [1, bad], [None, bad], [bad, None]):  # alone, after ints, among Nones
            with pytest.raises(ProtocolError, match=f"holds a {kind}, expected int"):
                decode_body(_pack({"tables": {"scalars": {"step": cells, "name": ["a"] * len(cells),
                                                          "value": [0.5] * len(cells)}}}))


_wide_int = st.integers(-(2**63), 2**64 - 1)
_typed = {
    "int": st.none() | _wide_int | st.booleans(),
    "real": st.none() | st.floats(allow_nan=False) | _wide_int | st.booleans(),
    "text": st.none() | st.text(max_size=3) | st.integers(0, 3),
}


@st.composite
def _bodies(draw: st.DrawFn) -> dict[str, Any]:
    """Bodies near the fast path: known tables with most columns present, mostly well typed."""
    tables: dict[str, Any] = {}
    for name in draw(st.lists(st.sampled_from(sorted(TABLES)), max_size=3, unique=True)):
        n = draw(st.integers(0, 4))
        table: dict[str, Any] = {}
        for col, kind in TABLES[name]:
            if draw(st.integers(0, 9)) == 0:
                continue  # a missing column
            length = n if draw(st.integers(0, 19)) else n + 1  # now and then a ragged one
            table[col] = draw(st.lists(_typed[kind], min_size=length, max_size=length))
        tables[name] = table
    return tables


def _reference(tables: dict[str, Any]) -> dict[str, dict[str, list[Any]]] | None:
    """What decode must return (None: a ProtocolError), from the rules stated in the module."""
    allowed = {"int": (int, bool, type(None)), "real": (int, float, bool, type(None)), "text": (str, type(None))}
    out: dict[str, dict[str, list[Any]]] = {}
    for name, table in tables.items():
        lengths = {len(v) for v in table.values()}
        if len(lengths) > 1:
            return None
        for col, kind in TABLES[name]:
            for v in table.get(col, []):
                if type(v) not in allowed[kind]:
                    return None
                if type(v) is int and not -(2**63) <= v < 2**63:
                    return None
        n = lengths.pop() if lengths else 0
        if n:
            out[name] = {col: list(table.get(col, [None] * n)) for col in columns(name)}
    return out


@settings(max_examples=400, deadline=None)
@given(_bodies())
def test_fast_path_agrees_with_the_rules(tables: dict[str, Any]) -> None:
    expected = _reference(tables)
    try:
        got = decode_body(_pack({"tables": tables}))
    except ProtocolError:
        assert expected is None
        return
    assert got == expected
