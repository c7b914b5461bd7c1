"""Length-prefixed msgpack frames: a pure encoder and an incremental decoder.

A frame is a 4-byte big-endian unsigned length followed by that many bytes of
one msgpack map. The decoder is fed arbitrary splits of the byte stream and
yields whole frame bodies; it refuses a declared length over the cap as soon
as the header is complete, so an attacker cannot make it buffer 4 GiB.

A body's decoded size is bounded too (``DecodeLimits``, one per frame kind):
a byte of msgpack can become a Python object of some sixty bytes, so a frame
of empty arrays would otherwise expand to dozens of times its length.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from traceml_wire.errors import FrameTooLarge, ProtocolError

HEADER_BYTES = 4
# The daemon's cap on one frame from a relay (``serve --max-frame-bytes``). Every
# other size limit on the path agent -> relay -> daemon is derived from it below,
# so the three peers cannot disagree about what fits.
DEFAULT_MAX_FRAME_BYTES = 16 * 1024 * 1024
# What an rbatch holding a single agent body adds around that body: its own keys
# and seq, the item's sender (<= 200 chars) and seq, that sender's identity and the
# node's (clean_identity keeps 8 ints and 4 strings of <= 256 chars each) and the
# relay's stats (a few dozen counters) and its sender id. The worst case is under 16 KiB
# (tests/traceml_wire/test_limits.py measures it); the rest is room for additive fields.
RBATCH_OVERHEAD_BYTES = 64 * 1024
# What a ``batch`` message adds around its body: {t, seq, body} is ~30 bytes.
BATCH_OVERHEAD_BYTES = 1024
# The largest agent batch body: alone in an rbatch it still fits the daemon's cap.
MAX_AGENT_BODY_BYTES = DEFAULT_MAX_FRAME_BYTES - RBATCH_OVERHEAD_BYTES
# The relay's cap on one agent frame: every body the agent may send passes it, so a
# body is never refused on every resend until the agent's buffer evicts it.
MAX_AGENT_FRAME_BYTES = MAX_AGENT_BODY_BYTES + BATCH_OVERHEAD_BYTES
# The largest frame a server (relay or daemon) reads before it accepted the peer's
# hello. A hello is well under 1 KiB; with the full cap, 1024 unauthenticated peers
# could make a server buffer 16 GiB inside the hello timeout.
MAX_HELLO_FRAME_BYTES = 64 * 1024
_HEADER = struct.Struct(">I")
# The most agent batches a relay packs into one rbatch: the daemon's decode limits for
# rbatches are sized on it (an item costs a few decoded objects, whatever its body).
MAX_RBATCH_ITEMS = 4096


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    """What one frame body may decode into. msgpack refuses a string, bin, array or
    map longer than its cap from the length in its header; ``max_entries`` (the
    entries of every array and map together) and ``max_depth`` (nesting) are
    counted as containers complete, so decoding stops once either is passed."""

    max_str_len: int
    max_bin_len: int
    max_array_len: int
    max_map_len: int
    max_entries: int
    max_depth: int
    max_ext_len: int = 64


# Every message but the batches is a small map of scalars, with an identity map in a
# hello; the room above that is for additive fields.
SMALL_MESSAGE_LIMITS = DecodeLimits(
    max_str_len=MAX_HELLO_FRAME_BYTES,
    max_bin_len=1024,
    max_array_len=256,
    max_map_len=256,
    max_entries=4096,
    max_depth=32,
)


def batch_limits(max_frame_bytes: int) -> DecodeLimits:
    """An agent's ``batch``: its body is one bin (opaque here), the rest is small."""
    return DecodeLimits(
        max_str_len=MAX_HELLO_FRAME_BYTES,
        max_bin_len=max_frame_bytes,
        max_array_len=256,
        max_map_len=256,
        max_entries=4096,
        max_depth=32,
    )


def rbatch_limits(max_frame_bytes: int) -> DecodeLimits:
    """A relay's ``rbatch``: up to MAX_RBATCH_ITEMS items of three fields and as many
    peers, each with an identity map of a few dozen fields at most."""
    return DecodeLimits(
        max_str_len=MAX_HELLO_FRAME_BYTES,
        max_bin_len=max_frame_bytes,
        max_array_len=MAX_RBATCH_ITEMS,
        max_map_len=MAX_RBATCH_ITEMS,
        max_entries=64 * MAX_RBATCH_ITEMS,
        max_depth=32,
    )


# Any frame a peer may send under the default cap; for callers that do not know the kind.
ANY_FRAME_LIMITS = rbatch_limits(DEFAULT_MAX_FRAME_BYTES)


def pack_message(message: dict[str, Any]) -> bytes:
    """msgpack-encode one message map (bin type for bytes, str for text)."""
    return msgpack.packb(message, use_bin_type=True)


def encode_frame(message: dict[str, Any] | bytes) -> bytes:
    """Frame a message map, or an already packed body, with its length header."""
    body = message if isinstance(message, (bytes, bytearray, memoryview)) else pack_message(message)
    return _HEADER.pack(len(body)) + bytes(body)


class _Tally:
    """Counts a body's entries and nesting while msgpack builds it; raises once a
    limit is passed, which ends the decode there. Containers complete inside out,
    so a container's depth is one more than the deepest of its children, whose
    depths were noted when they completed."""

    __slots__ = ("_limits", "_entries", "_depths")

    def __init__(self, limits: DecodeLimits) -> None:
        self._limits = limits
        self._entries = 0
        self._depths: dict[int, int] = {}

    def _count(self, container: object, children: Any) -> None:
        self._entries += len(children)
        if self._entries > self._limits.max_entries:
            raise ProtocolError(f"frame body holds more than {self._limits.max_entries} entries")
        depth = 1
        for child in children:
            if type(child) is list or type(child) is dict:
                below = self._depths.pop(id(child), 1) + 1
                if below > depth:
                    depth = below
        if depth > self._limits.max_depth:
            raise ProtocolError(f"frame body nests deeper than {self._limits.max_depth} levels")
        self._depths[id(container)] = depth

    def on_list(self, value: list[Any]) -> list[Any]:
        self._count(value, value)
        return value

    def on_map(self, value: dict[Any, Any]) -> dict[Any, Any]:
        self._count(value, value.values())
        return value


def unpack_message(body: bytes, limits: DecodeLimits = ANY_FRAME_LIMITS) -> dict[str, Any]:
    """Decode one frame body into a message map with a string type field ``t``,
    within ``limits`` (sized for the kind of frame the caller expects).

    Raises ProtocolError for anything else: garbage, trailing bytes, a non-map,
    a map without a string ``t``, a body over its limits.
    """
    tally = _Tally(limits)
    try:
        message = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=False,
            max_str_len=limits.max_str_len,
            max_bin_len=limits.max_bin_len,
            max_array_len=limits.max_array_len,
            max_map_len=limits.max_map_len,
            max_ext_len=limits.max_ext_len,
            list_hook=tally.on_list,
            object_hook=tally.on_map,
        )
    except ProtocolError:
        raise
    except ValueError as exc:
        # msgpack's own caps say "N exceeds max_array_len(M)": our numbers, safe to repeat.
        text = str(exc)
        if " exceeds max_" in text:
            raise ProtocolError(f"frame body over its decode limits: {text}") from None
        raise ProtocolError(f"frame body is not valid msgpack: {exc.__class__.__name__}") from None
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"frame body is not valid msgpack: {exc.__class__.__name__}") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"frame body must be a map, got {type(message).__name__}")
    kind = message.get("t")
    if not isinstance(kind, str):
        raise ProtocolError("message has no string type field 't'")
    return message


class FrameDecoder:
    """Incremental frame splitter.

    Two ways to drive it: ``feed(data)`` returns every frame body now complete;
    or ``append(data)`` then ``next_frame()`` one body at a time, which lets the
    caller change ``max_frame_bytes`` between frames (a server raises it once the
    peer is accepted) and read ``next_frame_length`` (the declared length of the
    frame whose header is in, so a server can reserve that much before it reads
    the body). A declared length over the cap is refused from the 4-byte header
    alone, before any of the body is buffered.

    A fed chunk that is exactly one frame body (a server reading header and body
    separately) comes back as the same object, not a copy. After an error the
    decoder is poisoned: the stream has lost framing and the connection must close.
    """

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        if max_frame_bytes <= 0:
            raise ValueError("max_frame_bytes must be positive")
        self.max_frame_bytes = max_frame_bytes
        self._data: bytes | bytearray = b""  # unread bytes are self._data[self._pos:]
        self._pos = 0
        self._need: int | None = None  # body length of the frame whose header was read
        self._error: ProtocolError | None = None
        self.frames_decoded = 0
        self.bytes_decoded = 0

    @property
    def buffered_bytes(self) -> int:
        """Bytes held and not yet returned (a header already parsed is not counted)."""
        return len(self._data) - self._pos

    @property
    def in_frame(self) -> bool:
        """True while part of a frame (header or body) has been read: EOF now cuts a frame."""
        return self._need is not None or self.buffered_bytes > 0

    @property
    def next_frame_length(self) -> int | None:
        """The declared body length of the frame being read, once its header is in."""
        return self._need

    def feed(self, data: bytes) -> list[bytes]:
        """Add bytes from the stream; return every frame body now complete."""
        self.append(data)
        out: list[bytes] = []
        while (body := self.next_frame()) is not None:
            out.append(body)
        return out

    def append(self, data: bytes) -> None:
        """Hold ``data`` for ``next_frame``; nothing is parsed yet."""
        if self._error is not None:
            raise self._error
        if not data:
            return
        if not isinstance(data, bytes):
            data = bytes(data)  # a caller's bytearray may change after this returns
        if self._pos == len(self._data):
            # Nothing held: keep a reference instead of copying (the common case of a
            # server that reads exactly one body, or a chunk of whole frames).
            self._data, self._pos = data, 0
            return
        if isinstance(self._data, bytearray):
            if self._pos > 65536 and self._pos * 2 > len(self._data):
                del self._data[: self._pos]
                self._pos = 0
        else:
            self._data, self._pos = bytearray(memoryview(self._data)[self._pos :]), 0
        self._data += data

    def next_frame(self) -> bytes | None:
        """The next whole frame body, or None until more bytes arrive.

        Raises FrameTooLarge (as soon as a header declares more than
        ``max_frame_bytes``) or the error that poisoned the decoder before.
        """
        if self._error is not None:
            raise self._error
        if self._need is None:
            if self.buffered_bytes < HEADER_BYTES:
                return None
            (declared,) = _HEADER.unpack_from(self._data, self._pos)
            if declared > self.max_frame_bytes:
                self._error = FrameTooLarge(declared, self.max_frame_bytes)
                self._data, self._pos = b"", 0
                raise self._error
            self._pos += HEADER_BYTES
            self._need = declared
        need = self._need
        if self.buffered_bytes < need:
            return None
        start, data = self._pos, self._data
        if start == 0 and need == len(data) and isinstance(data, bytes):
            body = data
        else:
            body = bytes(memoryview(data)[start : start + need])
        self._pos += need
        if self._pos == len(self._data):
            self._data, self._pos = b"", 0
        self._need = None
        self.frames_decoded += 1
        self.bytes_decoded += HEADER_BYTES + need
        return body

    def expected_bytes(self) -> int:
        """How many more bytes complete the current header or body (>= 1)."""
        if self._need is None:
            return max(1, HEADER_BYTES - self.buffered_bytes)
        return max(1, self._need - self.buffered_bytes)
