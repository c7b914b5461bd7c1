"""Length-prefixed msgpack frames: a pure encoder and an incremental decoder.

A frame is a 4-byte big-endian unsigned length followed by that many bytes of
one msgpack map. The decoder is fed arbitrary splits of the byte stream and
yields whole frame bodies; it refuses a declared length over the cap as soon
as the header is complete, so an attacker cannot make it buffer 4 GiB.
"""

from __future__ import annotations

import struct
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


def pack_message(message: dict[str, Any]) -> bytes:
    """msgpack-encode one message map (bin type for bytes, str for text)."""
    return msgpack.packb(message, use_bin_type=True)


def encode_frame(message: dict[str, Any] | bytes) -> bytes:
    """Frame a message map, or an already packed body, with its length header."""
    body = message if isinstance(message, (bytes, bytearray, memoryview)) else pack_message(message)
    return _HEADER.pack(len(body)) + bytes(body)


def unpack_message(body: bytes) -> dict[str, Any]:
    """Decode one frame body into a message map with a string type field ``t``.

    Raises ProtocolError for anything else: garbage, trailing bytes, a non-map,
    a map without a string ``t``.
    """
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=False)
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
