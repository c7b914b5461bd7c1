"""The frame caps of the three peers, derived from one number, fit inside each other."""

from __future__ import annotations

from relay.upstream import RelayStats
from traceml_wire import (
    BATCH_OVERHEAD_BYTES,
    DEFAULT_MAX_FRAME_BYTES,
    MAX_AGENT_BODY_BYTES,
    MAX_AGENT_FRAME_BYTES,
    RBATCH_OVERHEAD_BYTES,
    FrameDecoder,
    encode_frame,
    messages,
    pack_message,
    unpack_message,
)
from traceml_wire.framing import HEADER_BYTES

WIDE = "\U0001f642"  # 4 bytes in UTF-8: the widest character a string field can hold
INT64_MAX = 2**63 - 1


def worst_identity() -> dict[str, object]:
    """The largest identity clean_identity lets through: every field, strings at their cap."""
    raw: dict[str, object] = {k: INT64_MAX for k in messages.IDENTITY_INT_FIELDS}
    raw.update({k: WIDE * 1000 for k in messages.IDENTITY_STR_FIELDS})
    return messages.clean_identity(raw)


def test_caps_are_ordered_agent_body_then_agent_frame_then_daemon_frame() -> None:
    assert MAX_AGENT_BODY_BYTES < MAX_AGENT_FRAME_BYTES < DEFAULT_MAX_FRAME_BYTES
    assert MAX_AGENT_FRAME_BYTES - MAX_AGENT_BODY_BYTES == BATCH_OVERHEAD_BYTES
    assert DEFAULT_MAX_FRAME_BYTES - MAX_AGENT_BODY_BYTES == RBATCH_OVERHEAD_BYTES


def test_a_max_agent_batch_passes_the_relays_decoder() -> None:
    frame = encode_frame(messages.batch(INT64_MAX, b"b" * MAX_AGENT_BODY_BYTES))
    assert len(frame) - HEADER_BYTES <= MAX_AGENT_FRAME_BYTES
    (body,) = FrameDecoder(MAX_AGENT_FRAME_BYTES).feed(frame)
    assert len(body) == len(frame) - HEADER_BYTES


def test_an_rbatch_of_one_max_agent_body_passes_the_daemons_decoder() -> None:
    sender = WIDE * 200  # hello allows 200 characters
    stats = {name: INT64_MAX for name in RelayStats().as_dict()}
    message = messages.relay_batch(
        INT64_MAX, [[sender, INT64_MAX, b"b" * MAX_AGENT_BODY_BYTES]], {sender: worst_identity()}, worst_identity(),
        stats, sender=sender,
    )
    packed = pack_message(message)
    envelope = len(packed) - MAX_AGENT_BODY_BYTES
    # The derivation's assumption: the envelope is small against the room it is given.
    assert envelope <= 16 * 1024 < RBATCH_OVERHEAD_BYTES
    (body,) = FrameDecoder(DEFAULT_MAX_FRAME_BYTES).feed(encode_frame(packed))
    decoded = messages.validate_client_message(unpack_message(body))
    assert decoded["items"][0][2] == b"b" * MAX_AGENT_BODY_BYTES and decoded["sender"] == sender
