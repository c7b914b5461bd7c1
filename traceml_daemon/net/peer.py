"""Per-connection protocol state machine of the daemon (sans-I/O).

The server shell feeds received bytes in and writes the bytes this class
returns; everything about the conversation (challenge, hello timeout is the
shell's job, MAC check, which messages are legal when) lives here, so it can
be tested without sockets.

    AWAIT_HELLO --hello ok--> OPEN --bye--> CLOSED
         \\--bad hello / bad MAC--> CLOSED (refused)
    any protocol error or oversize frame --> CLOSED (for this peer only)
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from traceml_daemon.store.policy import DEFAULT_POLICY
from traceml_wire import auth, messages
from traceml_wire.errors import FrameTooLarge, ProtocolError
from traceml_wire.framing import DEFAULT_MAX_FRAME_BYTES, FrameDecoder, encode_frame, unpack_message


class State(enum.Enum):
    AWAIT_HELLO = "await_hello"
    OPEN = "open"
    CLOSED = "closed"


@dataclass
class Hello:
    """A peer authenticated: who it is."""

    role: str
    sender: str
    session: str
    identity: dict[str, Any]


@dataclass
class Batch:
    """A numbered batch, normalised to the relay shape (``batch`` from an agent
    becomes a one-item rbatch with the agent as its own relay)."""

    seq: int
    items: list[list[Any]]
    peers: dict[str, dict[str, Any]]
    node: dict[str, Any]
    stats: dict[str, int]
    nbytes: int


@dataclass
class Refused:
    reason: str


@dataclass
class Failed:
    """The peer broke the protocol; ``oversize`` marks a frame over the cap."""

    reason: str
    oversize: bool = False


@dataclass
class Closed:
    """The peer said bye."""


Event = Hello | Batch | Refused | Failed | Closed


@dataclass
class PeerSession:
    token: str | None
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    nonce: bytes = field(default_factory=auth.new_nonce)
    state: State = State.AWAIT_HELLO
    hello: Hello | None = None
    frames_received: int = 0

    def __post_init__(self) -> None:
        self._decoder = FrameDecoder(self.max_frame_bytes)
        # Cleaned peer identities of this connection's rbatches (see messages._cleaned).
        self._identities: messages.IdentityCache = {}

    # ----------------------------------------------------------- outbound

    def challenge(self) -> bytes:
        return encode_frame(messages.challenge(self.nonce))

    @staticmethod
    def accept(last_seq: int = 0) -> bytes:
        return encode_frame(messages.accept(last_seq))

    @staticmethod
    def ack(seq: int) -> bytes:
        return encode_frame(messages.ack(seq))

    def refuse(self, reason: str) -> bytes:
        self.state = State.CLOSED
        return encode_frame(messages.refuse(reason))

    # ------------------------------------------------------------ inbound

    def expected_bytes(self) -> int:
        return self._decoder.expected_bytes()

    def receive(self, data: bytes) -> list[Event]:
        """Feed bytes from the socket; return what happened, in order. Once an
        event closes the session, later frames in the same chunk are ignored."""
        if self.state is State.CLOSED:
            return []
        try:
            bodies = self._decoder.feed(data)
        except FrameTooLarge as exc:
            self.state = State.CLOSED
            return [Failed(str(exc), oversize=True)]
        except ProtocolError as exc:
            self.state = State.CLOSED
            return [Failed(str(exc))]
        return self._on_frames(bodies)

    def receive_frame(self, body: bytes) -> list[Event]:
        """Like ``receive`` for one whole frame body the caller already split from the
        stream (the daemon reads frame by frame to reserve each one's bytes first):
        the body is not copied through the decoder again."""
        if self.state is State.CLOSED:
            return []
        if len(body) > self.max_frame_bytes:
            self.state = State.CLOSED
            return [Failed(str(FrameTooLarge(len(body), self.max_frame_bytes)), oversize=True)]
        return self._on_frames((body,))

    def _on_frames(self, bodies: Iterable[bytes]) -> list[Event]:
        events: list[Event] = []
        for body in bodies:
            self.frames_received += 1
            event = self._on_frame(body)
            if event is not None:
                events.append(event)
            if isinstance(event, Refused):
                self.state = State.CLOSED
            if self.state is State.CLOSED:
                break
        return events

    def _on_frame(self, body: bytes) -> Event | None:
        try:
            message = messages.validate_client_message(
                unpack_message(body), self._identities, DEFAULT_POLICY.identity_cache_entries
            )
        except ProtocolError as exc:
            if self.state is State.AWAIT_HELLO:
                # A bad hello is refused with its reason so the peer can tell
                # "wrong version" from "network trouble".
                return Refused(f"bad hello: {exc}")
            self.state = State.CLOSED
            return Failed(str(exc))
        kind = message["t"]
        if self.state is State.AWAIT_HELLO:
            if kind != messages.HELLO:
                return Refused(f"expected hello, got {kind!r}")
            return self._on_hello(message)
        if kind == messages.HELLO:
            self.state = State.CLOSED
            return Failed("second hello on an open connection")
        if kind == messages.BYE:
            self.state = State.CLOSED
            return Closed()
        assert self.hello is not None
        if kind == messages.RELAY_BATCH:
            if self.hello.role != messages.ROLE_RELAY:
                self.state = State.CLOSED
                return Failed("only relays send rbatch")
            return Batch(
                seq=message["seq"],
                items=message["items"],
                peers=message["peers"],
                node=message["node"],
                stats=message["stats"],
                nbytes=len(body),
            )
        # kind == BATCH: an agent talking to the daemon directly acts as its
        # own relay, so the rest of the daemon only ever sees the rbatch shape.
        if self.hello.role != messages.ROLE_AGENT:
            self.state = State.CLOSED
            return Failed("only agents send batch")
        identity = self.hello.identity
        node = {k: identity[k] for k in ("node_rank", "hostname") if k in identity}
        return Batch(
            seq=message["seq"],
            items=[[self.hello.sender, message["seq"], message["body"]]],
            peers={self.hello.sender: identity},
            node=node,
            stats={},
            nbytes=len(body),
        )

    def _on_hello(self, message: dict[str, Any]) -> Event:
        role, sender = message["role"], message["sender"]
        if not auth.verify_hello_mac(self.token, self.nonce, role, sender, message["mac"]):
            return Refused("bad token (hello MAC does not verify)")
        self.state = State.OPEN
        self.hello = Hello(role=role, sender=sender, session=message["session"], identity=message["identity"])
        return self.hello
