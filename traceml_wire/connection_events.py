"""The events a connection's ``receive_data`` returns, one per frame read.

Each is a frozen record of what the peer said (validated and cleaned by
``traceml_wire.messages``); which side sees which is in its docstring.
``Event`` is their union, matched on by the I/O shells.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Challenge:
    """Client: the server's nonce arrived; send the hello."""

    nonce: bytes


@dataclass(frozen=True, slots=True)
class Accepted:
    """Client: accepted. ``verified``: the server proved it holds the token."""

    last_seq: int
    verified: bool


@dataclass(frozen=True, slots=True)
class Refused:
    """Client: the server refused (before or after accepting)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Ack:
    """Client: every batch with a seq <= ``seq`` is safe on the server."""

    seq: int


@dataclass(frozen=True, slots=True)
class Unverified:
    """Client with a token: the accept carried no valid proof. Whatever holds the
    port does not know the token; send it nothing."""

    reason: str


@dataclass(frozen=True, slots=True)
class Hello:
    """Server: an authenticated hello; ``send_accept`` or ``send_refuse`` next."""

    role: str
    sender: str
    session: str
    identity: dict[str, Any]
    caps: frozenset[str] = frozenset()  # what the client can be sent (messages.KNOWN_CAPS)


@dataclass(frozen=True, slots=True)
class BadHello:
    """Server: the first frame was not an acceptable hello (malformed, oversize,
    wrong role, bad MAC ...); ``send_refuse(reason)`` next. ``declared``: the
    length an oversize frame's header declared."""

    reason: str
    oversize: bool = False
    declared: int | None = None


@dataclass(frozen=True, slots=True)
class Batch:
    """Server: an agent's numbered batch; ``body`` is opaque bytes."""

    seq: int
    body: bytes
    nbytes: int  # the frame body's length


@dataclass(frozen=True, slots=True)
class RelayBatch:
    """Server: a relay's numbered rbatch (fields validated and cleaned)."""

    seq: int
    items: list[list[Any]]
    peers: dict[str, dict[str, Any]]
    node: dict[str, Any]
    stats: dict[str, int]
    sender: str | None
    spool_dropped_upto: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Bye:
    """Server: the client ended the stream cleanly."""


@dataclass(frozen=True, slots=True)
class ProtocolFailure:
    """Either side: the peer broke the protocol; this connection is over."""

    reason: str
    oversize: bool = False
    declared: int | None = None


@dataclass(frozen=True, slots=True)
class Control:
    """Client: a request from the server (validated), for the agent ``sender``."""

    op: str
    sender: str
    steps: int
    request_id: str


@dataclass(frozen=True, slots=True)
class ControlRefused:
    """Client: a control message that failed validation; dropped, the connection stays open."""

    reason: str


@dataclass(frozen=True, slots=True)
class Request:
    """Server: a control client's request (validated)."""

    op: str
    rank: int
    steps: int
    request_id: str
    session: str | None


@dataclass(frozen=True, slots=True)
class Answer:
    """Control client: the server's answer to its request."""

    request_id: str
    status: str  # "sent" | "refused"
    message: str
    sender: str | None
    session: str | None


Event = (
    Challenge | Accepted | Refused | Ack | Unverified | Hello | BadHello | Batch | RelayBatch | Bye | ProtocolFailure
    | Control | ControlRefused | Request | Answer
)
