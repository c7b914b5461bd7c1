"""The identity declaration and the check every hello and rbatch identity passes."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from traceml_wire import messages
from traceml_wire.errors import ProtocolError
from traceml_wire.framing import pack_message, unpack_message
from traceml_wire.identity import (
    IDENTITY,
    IDENTITY_FIELDS,
    IDENTITY_INT_FIELDS,
    IDENTITY_NAMES,
    IDENTITY_STR_FIELDS,
    INT64_MAX,
    MAX_CHARS,
    NODE_FIELDS,
    CleanIdentity,
    clean_identity,
)
from traceml_wire.tables import INT, TEXT

GOOD: dict[str, Any] = {
    "session": "job42", "attempt": 2, "global_rank": 5, "local_rank": 1, "node_rank": 1, "world_size": 8,
    "local_world_size": 4, "nnodes": 2, "hostname": "gpu-a", "pid": 4242, "parallelism": "ddp", "device": "cuda:1",
}  # fmt: skip


def test_the_declaration_names_each_field_once_with_a_known_kind() -> None:
    assert len(set(IDENTITY_NAMES)) == len(IDENTITY) and set(IDENTITY_FIELDS) == set(IDENTITY_NAMES)
    assert all(f.kind in (INT, TEXT) for f in IDENTITY)
    assert set(IDENTITY_INT_FIELDS) | set(IDENTITY_STR_FIELDS) == set(IDENTITY_NAMES)
    assert set(GOOD) == set(IDENTITY_NAMES)  # this file's example covers every field
    # One name for the run: "run_id" survives only as an alias read on input.
    assert "run_id" not in IDENTITY_NAMES and IDENTITY_FIELDS["session"].aliases == ("run_id",)
    # The fields a relay's node map may state, never the hostname alone.
    assert NODE_FIELDS == ("node_rank", "hostname")
    # Readers key runs by these: the daemon never stores them NULL.
    assert {f.name for f in IDENTITY if f.default is not None} == {"session", "attempt"}


def test_messages_reexports_the_declared_fields_and_check() -> None:
    assert messages.IDENTITY_INT_FIELDS == IDENTITY_INT_FIELDS
    assert messages.IDENTITY_STR_FIELDS == IDENTITY_STR_FIELDS
    assert messages.clean_identity is clean_identity


def test_a_good_identity_passes_unchanged() -> None:
    out = clean_identity(GOOD)
    assert out == GOOD and out.refused == () and isinstance(out, CleanIdentity)


def test_unknown_keys_are_ignored_and_not_counted() -> None:
    out = clean_identity({"global_rank": 1, "future_field": [1, 2], 7: "int key"})
    assert out == {"global_rank": 1} and out.refused == ()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("pid", 2**63),  # one past SQLite's INTEGER: would fail the daemon's insert
        ("pid", 2**64 - 1),  # the largest msgpack uint
        ("global_rank", -1),
        ("attempt", -3),
        ("world_size", 0),
        ("local_world_size", 0),
        ("nnodes", 0),
        ("local_rank", True),  # a bool is not a rank
        ("node_rank", 1.0),
        ("node_rank", "1"),
        ("hostname", 7),
        ("session", b"bytes"),
        ("device", ["cuda"]),
    ],
)
def test_a_bad_value_is_dropped_and_named(field: str, value: object) -> None:
    out = clean_identity({**GOOD, field: value})
    assert field not in out and out.refused == (field,)
    assert out == {k: v for k, v in GOOD.items() if k != field}


@pytest.mark.parametrize(("field", "value"), [("pid", INT64_MAX), ("global_rank", 0), ("world_size", 1)])
def test_the_bounds_themselves_are_accepted(field: str, value: int) -> None:
    out = clean_identity({field: value})
    assert out == {field: value} and out.refused == ()


def test_every_refused_field_is_named_in_declaration_order() -> None:
    out = clean_identity({"pid": 2**63, "hostname": None, "nnodes": -1, "global_rank": 3, "session": 5})
    assert out == {"global_rank": 3} and out.refused == ("session", "nnodes", "pid")  # None: not stated


def test_strings_are_cut_to_their_bound() -> None:
    long = "\U0001f642" * (MAX_CHARS + 50)
    out = clean_identity({"hostname": long, "session": "s" * 10_000})
    assert out == {"hostname": long[:MAX_CHARS], "session": "s" * MAX_CHARS} and out.refused == ()


def test_the_old_run_id_key_is_read_as_session() -> None:
    assert clean_identity({"run_id": "old-job", "global_rank": 0}) == {"session": "old-job", "global_rank": 0}
    # Both sent: the field's own name wins; an absent or null one falls back to the alias.
    assert clean_identity({"session": "new", "run_id": "old"}) == {"session": "new"}
    assert clean_identity({"session": None, "run_id": "old"}) == {"session": "old"}
    bad = clean_identity({"run_id": 12})
    assert bad == {} and bad.refused == ("session",)


@pytest.mark.parametrize("raw", [[1], "identity", None, 5])
def test_a_non_map_is_a_protocol_error(raw: object) -> None:
    with pytest.raises(ProtocolError):
        clean_identity(raw)


def test_a_clean_identity_travels_as_a_plain_map() -> None:
    out = clean_identity({**GOOD, "pid": 2**63})
    packed = msgpack.packb({"identity": out}, use_bin_type=True)
    assert msgpack.unpackb(packed, raw=False) == {"identity": {k: v for k, v in GOOD.items() if k != "pid"}}


def test_hello_and_rbatch_identities_go_through_the_check() -> None:
    hostile = {**GOOD, "pid": 2**63, "run_id": "ignored: session is stated"}
    hello = messages.hello(role="agent", sender="anything at all", session="s", identity=hostile, mac=b"m" * 32)
    checked = messages.validate_client_message(unpack_message(pack_message(hello)))["identity"]
    assert checked == {k: v for k, v in GOOD.items() if k != "pid"} and checked.refused == ("pid",)
    rbatch = messages.relay_batch(1, [["x", 1, b"b"]], {"x": hostile}, {"node_rank": -1, "hostname": "h"}, {})
    checked = messages.validate_client_message(unpack_message(pack_message(rbatch)))
    assert checked["peers"]["x"].refused == ("pid",) and "pid" not in checked["peers"]["x"]
    assert checked["node"] == {"hostname": "h"} and checked["node"].refused == ("node_rank",)
