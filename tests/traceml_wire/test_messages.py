"""Message builders and validators: types enforced, unknown fields ignored."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from traceml_wire import ProtocolError, pack_message, unpack_message
from traceml_wire import messages as m
from traceml_wire.auth import accept_proof, hello_mac, new_nonce, verify_accept_proof, verify_hello_mac


def _roundtrip(msg: dict[str, Any]) -> dict[str, Any]:
    return unpack_message(pack_message(msg))


def _hello(**over: Any) -> dict[str, Any]:
    msg = m.hello(role="agent", sender="s/a0/n0/r0/1-ab", session="s", identity={"global_rank": 0}, mac=b"x" * 32)
    msg.update(over)
    return msg


def test_builders_pass_their_own_validators() -> None:
    client = [
        _hello(),
        m.batch(1, b"body"),
        m.relay_batch(2, [["a", 1, b"b"]], {"a": {"global_rank": 1}}, {"node_rank": 0}, {"dropped_batches": 0}),
        m.bye(),
    ]
    for msg in client:
        assert m.validate_client_message(_roundtrip(msg))["t"] == msg["t"]
    client.append(_hello(cnonce=new_nonce()))
    server = [m.challenge(new_nonce()), m.accept(7), m.accept(7, proof=b"p" * 32), m.refuse("no"), m.ack(3)]
    for msg in server:
        assert m.validate_server_message(_roundtrip(msg))["t"] == msg["t"]


@pytest.mark.parametrize("kind", ["nope", "challenge", "ack", "accept"])
def test_unknown_or_wrong_direction_client_type_rejected(kind: str) -> None:
    with pytest.raises(ProtocolError):
        m.validate_client_message({"t": kind, "seq": 1})


@pytest.mark.parametrize("kind", ["nope", "hello", "batch", "bye"])
def test_unknown_or_wrong_direction_server_type_rejected(kind: str) -> None:
    with pytest.raises(ProtocolError):
        m.validate_server_message({"t": kind})


def test_unknown_fields_are_ignored() -> None:
    msg = _roundtrip({**m.batch(4, b"b"), "future": {"x": [1, 2]}, "v2_field": "y"})
    assert m.validate_client_message(msg)["seq"] == 4
    hello = m.validate_client_message(_roundtrip(_hello(extra=1, identity={"global_rank": 3, "gpu_uuid": "u"})))
    assert hello["identity"] == {"global_rank": 3}
    ack = m.validate_server_message({"t": "ack", "seq": 2, "window": 9})
    assert ack["seq"] == 2


@pytest.mark.parametrize(
    "over",
    [
        {"v": 2},
        {"v": "1"},
        {"role": "admin"},
        {"role": 1},
        {"sender": ""},
        {"sender": "x" * 201},
        {"sender": None},
        {"session": 5},
        {"mac": "not-bytes"},
        {"identity": [1]},
        {"cnonce": "text"},
        {"cnonce": b"short"},
        {"cnonce": b"x" * 65},
    ],
)
def test_hello_rejects_bad_fields(over: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError):
        m.validate_client_message(_hello(**over))


def test_hello_identity_is_cleaned_by_type() -> None:
    ident = {"global_rank": "0", "local_rank": True, "node_rank": 2, "hostname": "h" * 300, "device": 5}
    out = m.validate_client_message(_hello(identity=ident))["identity"]
    assert out == {"node_rank": 2, "hostname": "h" * 256}


@pytest.mark.parametrize("seq", [0, -1, True, 1.0, "1", None])
def test_batch_seq_must_be_positive_int(seq: object) -> None:
    with pytest.raises(ProtocolError):
        m.validate_client_message({"t": "batch", "seq": seq, "body": b""})


def test_batch_body_must_be_bytes() -> None:
    with pytest.raises(ProtocolError):
        m.validate_client_message({"t": "batch", "seq": 1, "body": "text"})


@pytest.mark.parametrize(
    "items",
    [
        "x",
        [["a", 1]],
        [["a", 1, "text"]],
        [[1, 1, b""]],
        [["a", True, b""]],
        [["a", 0, b""]],
        [("a", 1, b"", 4)],
    ],
)
def test_rbatch_rejects_bad_items(items: object) -> None:
    with pytest.raises(ProtocolError):
        m.validate_client_message({"t": "rbatch", "seq": 1, "items": items, "peers": {}})


def test_rbatch_cleans_peers_node_and_stats() -> None:
    msg = m.validate_client_message(
        {
            "t": "rbatch",
            "seq": 1,
            "items": [["a", 1, b"b"]],
            "peers": {"a": {"global_rank": 1, "junk": 2}},
            "node": {"node_rank": 1, "hostname": "h", "x": 1},
            "stats": {"dropped_batches": 2, "bad": "x", "flag": True},
        }
    )
    assert msg["peers"] == {"a": {"global_rank": 1}}
    assert msg["node"] == {"node_rank": 1, "hostname": "h"}
    assert msg["stats"] == {"dropped_batches": 2}
    bare = m.validate_client_message({"t": "rbatch", "seq": 1, "items": [], "peers": {}, "stats": [1]})
    assert bare["node"] == {} and bare["stats"] == {}


def test_rbatch_peers_must_be_a_map_of_maps() -> None:
    for peers in ([], {1: {}}, {"a": "x"}):
        with pytest.raises(ProtocolError):
            m.validate_client_message({"t": "rbatch", "seq": 1, "items": [], "peers": peers})


def test_server_messages_defaults() -> None:
    assert m.validate_server_message({"t": "accept"})["last_seq"] == 0
    assert m.validate_server_message({"t": "accept", "last_seq": True})["last_seq"] == 0
    assert m.validate_server_message({"t": "refuse", "reason": 3})["reason"] == "refused"
    assert "proof" not in m.validate_server_message({"t": "accept", "proof": "text"})  # counts as none
    with pytest.raises(ProtocolError):
        m.validate_server_message({"t": "challenge", "nonce": b"short"})
    with pytest.raises(ProtocolError):
        m.validate_server_message({"t": "ack", "seq": 0})


def test_mac_binds_token_nonce_role_and_sender() -> None:
    nonce = new_nonce()
    mac = hello_mac("tok", nonce, "agent", "s1")
    assert verify_hello_mac("tok", nonce, "agent", "s1", mac)
    assert not verify_hello_mac("other", nonce, "agent", "s1", mac)
    assert not verify_hello_mac("tok", new_nonce(), "agent", "s1", mac)
    assert not verify_hello_mac("tok", nonce, "relay", "s1", mac)
    assert not verify_hello_mac("tok", nonce, "agent", "s2", mac)
    assert not verify_hello_mac("tok", nonce, "agent", "s1", "text")
    assert verify_hello_mac(None, nonce, "agent", "s1", hello_mac("", nonce, "agent", "s1"))


def test_the_new_fields_are_additive() -> None:
    """Without a cnonce or a proof the messages are exactly the ones older peers send."""
    assert "cnonce" not in _hello() and m.accept(3) == {"t": "accept", "v": 1, "last_seq": 3}
    assert m.hello(role="agent", sender="s", session="s", identity={}, mac=b"m", cnonce=b"c" * 16)["cnonce"] == b"c" * 16


def test_proof_binds_token_both_nonces_role_sender_and_last_seq() -> None:
    cnonce, snonce = new_nonce(), new_nonce()
    proof = accept_proof("tok", cnonce, snonce, "agent", "s1", 4)
    assert verify_accept_proof("tok", cnonce, snonce, "agent", "s1", 4, proof)
    for args in [("other", cnonce, snonce, "agent", "s1", 4), ("tok", snonce, cnonce, "agent", "s1", 4),
                 ("tok", cnonce, snonce, "relay", "s1", 4), ("tok", cnonce, snonce, "agent", "s2", 4),
                 ("tok", cnonce, snonce, "agent", "s1", 5)]:
        assert not verify_accept_proof(*args, proof)
    assert not verify_accept_proof("tok", cnonce, snonce, "agent", "s1", 4, "text")


def test_a_hello_mac_is_never_a_proof_and_a_proof_never_a_mac() -> None:
    # Domain separation: the proof is keyed with a key derived from the token.
    nonce = new_nonce()
    mac = hello_mac("tok", nonce, "agent", "s1")
    assert not verify_accept_proof("tok", nonce, nonce, "agent", "s1", 0, mac)
    proof = accept_proof("tok", nonce, nonce, "agent", "s1", 0)
    assert not verify_hello_mac("tok", nonce, "agent", "s1", proof)


_any = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=5) | st.binary(max_size=5) | st.floats(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=10,
)
_keys = st.sampled_from(["t", "v", "seq", "body", "items", "peers", "node", "stats", "role", "sender", "session", "mac", "identity", "nonce", "last_seq", "reason", "cnonce", "proof"])


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(sorted(m.CLIENT_TYPES | m.SERVER_TYPES | {"zzz"})),
    st.dictionaries(_keys, _any, max_size=8),
)
def test_validators_raise_only_protocol_error(kind: str, fields: dict[str, Any]) -> None:
    for validate in (m.validate_client_message, m.validate_server_message):
        try:
            validate({**fields, "t": kind})
        except ProtocolError:
            pass


def test_rbatch_identities_cleaned_once_per_connection_and_again_when_changed() -> None:
    cache: m.IdentityCache = {}

    def rbatch(identity: dict[str, Any]) -> dict[str, Any]:
        msg = m.relay_batch(1, [["a", 1, b"b"]], {"a": identity}, {"node_rank": 0, "junk": 1}, {})
        return m.validate_client_message(_roundtrip(msg), cache)

    first = rbatch({"global_rank": 1, "junk": [1]})
    again = rbatch({"global_rank": 1, "junk": [1]})
    assert first["peers"]["a"] == {"global_rank": 1} and again["peers"]["a"] is first["peers"]["a"]
    assert again["node"] == {"node_rank": 0} and again["node"] is first["node"]
    changed = rbatch({"global_rank": 2, "local_rank": True})
    assert changed["peers"]["a"] == {"global_rank": 2}  # re-cleaned: the bool is dropped
    assert m.validate_client_message(_roundtrip(m.relay_batch(1, [], {"a": {"global_rank": 3}}, {}, {})))[
        "peers"
    ] == {"a": {"global_rank": 3}}  # no cache: as before


def test_identity_cache_is_bounded() -> None:
    cache: m.IdentityCache = {}
    for i in range(10):
        msg = m.relay_batch(1, [], {f"s{i}": {"global_rank": i}}, {}, {})
        m.validate_client_message(_roundtrip(msg), cache, max_identities=4)
        assert len(cache) <= 4


def test_rbatch_spool_fields_are_optional_and_typed() -> None:
    def check(message: dict[str, Any]) -> dict[str, Any]:
        return m.validate_client_message(unpack_message(pack_message(message)))

    old = check(m.relay_batch(1, [], {}, {}, {}))  # what relays before these fields sent
    assert "sender" not in m.relay_batch(1, [], {}, {}, {})
    assert old["sender"] is None and old["spool_dropped_upto"] == 0
    new = check(m.relay_batch(4, [], {}, {}, {}, sender="relay/s/n0/1-ab", spool_dropped_upto=3))
    assert new["sender"] == "relay/s/n0/1-ab" and new["spool_dropped_upto"] == 3
    junk = check({**m.relay_batch(4, [], {}, {}, {}), "sender": "x" * 201, "spool_dropped_upto": True})
    assert junk["sender"] is None and junk["spool_dropped_upto"] == 0
    junk = check({**m.relay_batch(4, [], {}, {}, {}), "sender": 7, "spool_dropped_upto": -2})
    assert junk["sender"] is None and junk["spool_dropped_upto"] == 0


def test_sequence_numbers_and_spool_marks_beyond_int64_never_pass_the_wire() -> None:
    with pytest.raises(ProtocolError, match="2\\*\\*63-1"):
        m.validate_client_message(m.relay_batch(2**63, [], {}, {}, {}))
    with pytest.raises(ProtocolError, match="2\\*\\*63-1"):
        m.validate_client_message(m.batch(2**64 - 1, b""))
    spooled = m.relay_batch(1, [], {}, {}, {}, sender="relay/s/n0/1-ab", spool_dropped_upto=2**64 - 1)
    assert m.validate_client_message(spooled)["spool_dropped_upto"] == 0
    assert m.validate_server_message(m.accept(2**64 - 1))["last_seq"] == 0
