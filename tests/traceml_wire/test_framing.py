"""Framing: encoder/decoder round trips, arbitrary stream splits, the size cap."""

from __future__ import annotations

import dataclasses
import struct
import tracemalloc

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from traceml_wire import (
    DEFAULT_MAX_FRAME_BYTES,
    HEADER_BYTES,
    FrameDecoder,
    FrameTooLarge,
    ProtocolError,
    encode_frame,
    pack_message,
    unpack_message,
)
from traceml_wire.framing import (
    MAX_RBATCH_ITEMS,
    SMALL_MESSAGE_LIMITS,
    batch_limits,
    rbatch_limits,
)

# Message maps as peers send them: a string type plus arbitrary msgpack-able fields.
_scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=20) | st.binary(max_size=40)
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
messages = st.builds(
    lambda t, fields: {**fields, "t": t},
    st.text(min_size=1, max_size=10),
    st.dictionaries(st.text(max_size=8), _values, max_size=5),
)


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, last = [], 0
    for p in points:
        out.append(data[last:p])
        last = p
    out.append(data[last:])
    return out


def test_encode_frame_is_length_prefixed_msgpack() -> None:
    frame = encode_frame({"t": "ack", "seq": 3})
    (length,) = struct.unpack(">I", frame[:HEADER_BYTES])
    assert length == len(frame) - HEADER_BYTES
    assert unpack_message(frame[HEADER_BYTES:]) == {"t": "ack", "seq": 3}


def test_encode_frame_accepts_prepacked_body() -> None:
    body = pack_message({"t": "bye"})
    assert encode_frame(body) == encode_frame({"t": "bye"})
    assert encode_frame(memoryview(body)) == encode_frame({"t": "bye"})


def test_bytes_stay_bytes_and_text_stays_text() -> None:
    msg = unpack_message(pack_message({"t": "batch", "body": b"\x00\xff", "s": "x"}))
    assert msg["body"] == b"\x00\xff" and isinstance(msg["body"], bytes)
    assert msg["s"] == "x"


def test_decoder_byte_by_byte() -> None:
    stream = encode_frame({"t": "a"}) + encode_frame({"t": "b", "x": 1})
    dec = FrameDecoder()
    got: list[bytes] = []
    for i in range(len(stream)):
        got += dec.feed(stream[i : i + 1])
    assert [unpack_message(b)["t"] for b in got] == ["a", "b"]
    assert dec.buffered_bytes == 0
    assert dec.frames_decoded == 2 and dec.bytes_decoded == len(stream)


def test_empty_body_frame_is_yielded_then_rejected_by_unpack() -> None:
    dec = FrameDecoder()
    assert dec.feed(b"\x00\x00\x00\x00") == [b""]
    with pytest.raises(ProtocolError):
        unpack_message(b"")


def test_expected_bytes_tracks_header_and_body() -> None:
    dec = FrameDecoder()
    assert dec.expected_bytes() == HEADER_BYTES
    frame = encode_frame({"t": "x"})
    dec.feed(frame[:2])
    assert dec.expected_bytes() == 2
    dec.feed(frame[2:5])
    assert dec.expected_bytes() == len(frame) - 5
    assert dec.feed(frame[5:]) != []
    assert dec.expected_bytes() == HEADER_BYTES


def test_oversize_header_raises_before_body_is_buffered() -> None:
    dec = FrameDecoder(max_frame_bytes=1024)
    with pytest.raises(FrameTooLarge) as info:
        dec.feed(struct.pack(">I", 1025) + b"x" * 100)
    assert info.value.declared == 1025 and info.value.cap == 1024
    assert dec.buffered_bytes == 0


def test_oversize_detected_from_header_alone() -> None:
    dec = FrameDecoder(max_frame_bytes=10)
    assert dec.feed(b"\xff\xff") == []
    with pytest.raises(FrameTooLarge):
        dec.feed(b"\xff\xff")
    assert dec.buffered_bytes == 0


def test_frame_at_cap_is_accepted() -> None:
    dec = FrameDecoder(max_frame_bytes=8)
    assert dec.feed(struct.pack(">I", 8) + b"12345678") == [b"12345678"]


def test_decoder_is_poisoned_after_error() -> None:
    dec = FrameDecoder(max_frame_bytes=4)
    with pytest.raises(FrameTooLarge):
        dec.feed(struct.pack(">I", 5))
    with pytest.raises(FrameTooLarge):
        dec.feed(encode_frame({"t": "x"}))


def test_default_cap_is_16_mib() -> None:
    assert DEFAULT_MAX_FRAME_BYTES == 16 * 1024 * 1024
    with pytest.raises(FrameTooLarge):
        FrameDecoder().feed(struct.pack(">I", DEFAULT_MAX_FRAME_BYTES + 1))


def test_nonpositive_cap_is_a_programming_error() -> None:
    with pytest.raises(ValueError):
        FrameDecoder(0)


@pytest.mark.parametrize(
    "body",
    [b"\xc1", pack_message([1, 2]), pack_message({"x": 1}), pack_message({"t": 5}), pack_message({"t": "a"}) + b"\x00"],
    ids=["garbage", "not-a-map", "no-type", "non-string-type", "trailing-bytes"],
)
def test_unpack_rejects(body: bytes) -> None:
    with pytest.raises(ProtocolError):
        unpack_message(body)


@settings(max_examples=150, deadline=None)
@given(st.lists(messages, max_size=8), st.lists(st.integers(0, 10_000), max_size=12))
def test_any_split_decodes_to_same_frames(msgs: list[dict], cuts: list[int]) -> None:
    stream = b"".join(encode_frame(m) for m in msgs)
    dec = FrameDecoder()
    bodies: list[bytes] = []
    for chunk in _split(stream, cuts):
        bodies += dec.feed(chunk)
    assert [unpack_message(b) for b in bodies] == [unpack_message(pack_message(m)) for m in msgs]
    assert dec.buffered_bytes == 0


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.lists(st.integers(0, 400), max_size=6))
def test_garbage_yields_frames_or_protocol_error_only(data: bytes, cuts: list[int]) -> None:
    dec = FrameDecoder(max_frame_bytes=64)
    try:
        for chunk in _split(data, cuts):
            for body in dec.feed(chunk):
                assert len(body) <= 64
                try:
                    unpack_message(body)
                except ProtocolError:
                    pass
    except ProtocolError:
        pass
    assert dec.buffered_bytes <= 64 + HEADER_BYTES


@settings(max_examples=100, deadline=None)
@given(st.integers(65, 2**32 - 1), st.binary(max_size=200))
def test_oversize_never_buffers_body(declared: int, tail: bytes) -> None:
    dec = FrameDecoder(max_frame_bytes=64)
    with pytest.raises(FrameTooLarge):
        dec.feed(struct.pack(">I", declared) + tail)
    assert dec.buffered_bytes == 0


def test_next_frame_one_at_a_time_lets_the_cap_change_between_frames() -> None:
    dec = FrameDecoder(max_frame_bytes=8)
    dec.append(struct.pack(">I", 3) + b"abc" + struct.pack(">I", 20) + b"x" * 20)
    assert dec.next_frame() == b"abc"
    dec.max_frame_bytes = 32  # what a server does once it accepted the peer
    assert dec.next_frame() == b"x" * 20 and dec.next_frame() is None


def test_declared_length_is_known_once_the_header_is_in() -> None:
    dec = FrameDecoder()
    frame = encode_frame({"t": "x", "pad": b"p" * 100})
    dec.append(frame[:3])
    assert dec.next_frame() is None and dec.next_frame_length is None and dec.in_frame
    dec.append(frame[3:HEADER_BYTES])
    assert dec.next_frame() is None and dec.next_frame_length == len(frame) - HEADER_BYTES
    assert dec.in_frame and dec.buffered_bytes == 0
    body = frame[HEADER_BYTES:]
    dec.append(body)
    assert dec.next_frame() is body  # a chunk that is exactly the body is not copied
    assert dec.next_frame_length is None and not dec.in_frame


def test_appended_bytearrays_are_copied_before_the_caller_can_change_them() -> None:
    dec = FrameDecoder()
    chunk = bytearray(encode_frame({"t": "a"}))
    dec.append(chunk)
    expected = bytes(chunk[HEADER_BYTES:])
    chunk[-1:] = b"z"
    assert dec.next_frame() == expected


def test_append_after_an_error_raises_it_again() -> None:
    dec = FrameDecoder(max_frame_bytes=4)
    dec.append(struct.pack(">I", 5))
    with pytest.raises(FrameTooLarge):
        dec.next_frame()
    with pytest.raises(FrameTooLarge):
        dec.append(b"x")


# ------------------------------------------------------------ decode limits


def _raw_map(*pairs: tuple[str, bytes]) -> bytes:
    """A msgpack map whose values are given already packed (to build bodies no packer makes)."""
    out = bytearray(b"\xde" + len(pairs).to_bytes(2, "big"))
    for key, packed in pairs:
        out += msgpack.packb(key) + packed
    return bytes(out)


FOUR_MIB = 4 * 1024 * 1024


def empty_arrays_flat(n: int = FOUR_MIB) -> bytes:
    """An rbatch-looking map whose items are ``n`` empty arrays in one array."""
    return _raw_map(("t", msgpack.packb("rbatch")), ("seq", msgpack.packb(1)),
                    ("items", b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n))


def empty_arrays_nested(outer: int = 1024, inner: int = 4096) -> bytes:
    """The same bytes as arrays of at most ``inner`` entries: every array within its cap."""
    chunk = b"\xdc" + inner.to_bytes(2, "big") + b"\x90" * inner
    return _raw_map(("t", msgpack.packb("rbatch")), ("seq", msgpack.packb(1)),
                    ("items", b"\xdc" + outer.to_bytes(2, "big") + chunk * outer))


def nested_deep(depth: int = 1000) -> bytes:
    return _raw_map(("t", msgpack.packb("rbatch")), ("x", b"\x91" * depth + b"\x90"))


@pytest.mark.parametrize(
    ("body", "reason"),
    [(empty_arrays_flat(), "max_array_len"), (empty_arrays_nested(), "entries"), (nested_deep(), "nests deeper")],
    ids=["flat", "nested", "deep"],
)
def test_a_frame_that_would_expand_is_refused_before_it_does(body: bytes, reason: str) -> None:
    assert len(body) >= FOUR_MIB or reason == "nests deeper"
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match=reason):
            unpack_message(body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Unbounded, four million empty lists take hundreds of MB; stopped at the limit, a few dozen.
    assert peak < 40 * 1024 * 1024


def test_every_frame_kind_has_room_for_what_its_peers_legitimately_send() -> None:
    from traceml_wire import messages as wm

    identity = {k: 2**62 for k in wm.IDENTITY_INT_FIELDS} | {k: "h" * 256 for k in wm.IDENTITY_STR_FIELDS}
    senders = [f"s/a0/n0/r{i}/1-abcdef" for i in range(MAX_RBATCH_ITEMS)]
    rbatch = wm.relay_batch(1, [[s, 1, b"b" * 64] for s in senders], {s: dict(identity) for s in senders},
                            dict(identity), {"x": 1} | {f"c{i}": i for i in range(40)}, sender="relay/x")
    assert len(unpack_message(pack_message(rbatch), rbatch_limits(DEFAULT_MAX_FRAME_BYTES))["items"]) == len(senders)
    batch = wm.batch(1, b"b" * (DEFAULT_MAX_FRAME_BYTES - 1024))
    assert unpack_message(pack_message(batch), batch_limits(DEFAULT_MAX_FRAME_BYTES))["seq"] == 1
    hello = wm.hello(role="agent", sender="a" * 200, session="s" * 1000, identity={**identity, "future": [1, {"a": 2}]},
                     mac=b"m" * 32, cnonce=b"c" * 64)
    assert unpack_message(pack_message(hello), SMALL_MESSAGE_LIMITS)["sender"] == "a" * 200
    # What an agent may not put in a batch, a relay may put in an rbatch, and no more.
    wide = {"t": "batch", "seq": 1, "body": b"", "pad": [0] * 1000}
    with pytest.raises(ProtocolError, match="max_array_len"):
        unpack_message(pack_message(wide), batch_limits(DEFAULT_MAX_FRAME_BYTES))
    assert unpack_message(pack_message(wide), rbatch_limits(DEFAULT_MAX_FRAME_BYTES))["pad"] == [0] * 1000


def test_decode_limit_errors_never_echo_the_peers_bytes() -> None:
    with pytest.raises(ProtocolError) as info:
        unpack_message(_raw_map(("t", msgpack.packb("x")), ("s", msgpack.packb("\x1b[31m" * 100))),
                       dataclasses.replace(SMALL_MESSAGE_LIMITS, max_str_len=10))
    assert "\x1b" not in str(info.value)
