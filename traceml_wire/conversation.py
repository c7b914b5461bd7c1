"""The conversation of one connection, written once: sans-I/O state machines.

In the manner of h11's ``Connection``: nothing here touches a socket. A shell
feeds the bytes it read to ``receive_data(data)`` and acts on the events it
gets back; it asks the connection for the bytes of what it wants to say
(``send_hello``, ``send_batch``, ``send_accept``, ``send_ack`` ...) and writes
them. The agent's sender, both sides of the relay and the daemon are such
shells; the wire itself is described in ``traceml_wire.messages``.

    server (ServerConnection)                 client (ClientConnection)
    SEND_CHALLENGE --send_challenge-->        AWAIT_CHALLENGE
    AWAIT_HELLO   <--------------------hello- SEND_HELLO --send_hello--> AWAIT_ACCEPT
      | Hello event: DECIDE, or BadHello: MUST_REFUSE
    DECIDE --send_accept--> OPEN  ---accept(proof)--->  Accepted: OPEN (Unverified: FAILED)
      \\--send_refuse--> CLOSED   ---refuse---------->  Refused: CLOSED
    OPEN: Batch / RelayBatch events, send_ack  <-->  send_batch / send_rbatch, Ack events
    OPEN: Bye event: CLOSED                    <---  send_bye: CLOSED
    OPEN: send_control -------------------------->  Control event (ControlRefused: a bad one, counted)
    OPEN, role control: Request event  <-- send_request;  send_answer --> Answer event
    any protocol error after the hello: ProtocolFailure, FAILED (this connection only)

Calling a ``send_*`` the state does not allow raises ``LocalProtocolError`` (a
bug in the shell). What the peer does wrong comes back as an event and ends
this connection, never the process.

Frame caps per state: a server reads frames of at most ``MAX_HELLO_FRAME_BYTES``
until it accepted the hello, then ``max_frame_bytes``; what a frame may decode
into (``framing.DecodeLimits``) is sized the same way: small for a hello and
for everything a server says, for a batch or an rbatch by the peer's role. Once a hello arrived the
server reads nothing more until the shell accepted or refused it; bytes the
peer sent behind its hello wait in the decoder, and the shell calls
``receive_data(b"")`` after ``send_accept`` to take them.

With a token, authentication is mutual: the client proves the token with the
hello MAC over the server's nonce; the server proves it with the accept's
``proof`` over the client's nonce (``traceml_wire.auth``). A client that holds
a token and gets an accept without a valid proof sees ``Unverified`` and must
send nothing on that connection.

Control: a client that lists ``"control"`` in its hello's ``caps`` may be sent
``control`` requests once open (``send_control``). A malformed one comes back as
``ControlRefused`` and leaves the connection open (the shell counts it); a
control sent to a client that never listed the capability is a protocol error.
A server never sends one to a client that did not list it, so older clients,
which know no such type, never see one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from traceml_wire import auth, messages
from traceml_wire.errors import FrameTooLarge, ProtocolError
from traceml_wire.framing import (
    DEFAULT_MAX_FRAME_BYTES,
    MAX_HELLO_FRAME_BYTES,
    SMALL_MESSAGE_LIMITS,
    DecodeLimits,
    FrameDecoder,
    batch_limits,
    encode_frame,
    rbatch_limits,
    unpack_message,
)


class LocalProtocolError(RuntimeError):
    """This side asked for something its conversation does not allow now."""


class State(enum.Enum):
    SEND_CHALLENGE = "send_challenge"  # server: nothing said yet
    AWAIT_HELLO = "await_hello"  # server: challenge sent
    DECIDE = "decide"  # server: an authenticated hello, to accept or refuse
    MUST_REFUSE = "must_refuse"  # server: the peer's first frame was no acceptable hello
    AWAIT_CHALLENGE = "await_challenge"  # client: connected
    SEND_HELLO = "send_hello"  # client: challenge in hand
    AWAIT_ACCEPT = "await_accept"  # client: hello sent
    OPEN = "open"  # both: accepted; numbered batches and acks
    CLOSED = "closed"  # both: bye or refuse, a clean end
    FAILED = "failed"  # both: the peer broke the protocol; close the connection


# ------------------------------------------------------------------ events


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

# States in which frames are not taken from the decoder.
_NOT_READING = frozenset({State.SEND_CHALLENGE, State.DECIDE, State.MUST_REFUSE, State.CLOSED, State.FAILED})


class _Connection:
    def __init__(self, state: State, max_frame_bytes: int) -> None:
        self.state = state
        self._decoder = FrameDecoder(max_frame_bytes)
        self.frames_received = 0

    @property
    def next_frame_length(self) -> int | None:
        """The declared body length of the frame whose header is in and whose body is
        not (a server reserves that many bytes before reading them)."""
        return self._decoder.next_frame_length

    @property
    def in_frame(self) -> bool:
        """True while part of a frame has been read: an EOF now cuts a frame."""
        return self._decoder.in_frame

    def expected_bytes(self) -> int:
        """How many more bytes complete the current header or frame body."""
        return self._decoder.expected_bytes()

    def receive_data(self, data: bytes) -> list[Event]:
        """Feed bytes read from the peer; return what happened, in order.

        Stops at an event that ends the connection (later frames are ignored) and
        at a hello that waits for the shell's decision (later frames wait)."""
        if self.state is State.SEND_CHALLENGE:
            raise LocalProtocolError("send the challenge before reading the peer")
        if self.state in (State.CLOSED, State.FAILED, State.MUST_REFUSE):
            return []
        self._decoder.append(data)
        events: list[Event] = []
        while self.state not in _NOT_READING:
            try:
                body = self._decoder.next_frame()
            except FrameTooLarge as exc:
                events.append(self._broken(self._oversize_reason(exc), oversize=True, declared=exc.declared))
                break
            if body is None:
                break
            self.frames_received += 1
            try:
                events.append(self._on_message(unpack_message(body, self._decode_limits()), len(body)))
            except ProtocolError as exc:
                events.append(self._broken(str(exc)))
        return events

    def _oversize_reason(self, exc: FrameTooLarge) -> str:
        return str(exc)

    def _decode_limits(self) -> DecodeLimits:
        """What the next frame may decode into (every server message is small)."""
        return SMALL_MESSAGE_LIMITS

    def _broken(self, reason: str, *, oversize: bool = False, declared: int | None = None) -> Event:
        self.state = State.FAILED
        return ProtocolFailure(reason, oversize, declared)

    def _on_message(self, message: dict[str, Any], nbytes: int) -> Event:
        raise NotImplementedError

    def _require(self, *states: State, action: str) -> None:
        if self.state not in states:
            raise LocalProtocolError(f"cannot {action} in state {self.state.name}")


class ServerConnection(_Connection):
    """The server's side (relay for agents, daemon for relays and agents)."""

    def __init__(
        self,
        token: str | None,
        *,
        roles: frozenset[str] = messages.ROLES,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        identity_cache_entries: int = 65_536,
        nonce: bytes | None = None,
    ) -> None:
        super().__init__(State.SEND_CHALLENGE, min(MAX_HELLO_FRAME_BYTES, max_frame_bytes))
        self._token = token
        self.roles = roles
        self.max_frame_bytes = max_frame_bytes
        self._batch_limits = batch_limits(max_frame_bytes)
        self._rbatch_limits = rbatch_limits(max_frame_bytes)
        self.nonce = nonce if nonce is not None else auth.new_nonce()
        self.hello: Hello | None = None
        self._cnonce: bytes | None = None
        self._received_seq = 0  # highest batch seq on this connection
        # Cleaned rbatch peer and node identities of this connection (see messages._cleaned).
        self._identities: messages.IdentityCache = {}
        self._identity_cache_entries = identity_cache_entries

    # ----------------------------------------------------------- outbound

    def send_challenge(self) -> bytes:
        self._require(State.SEND_CHALLENGE, action="send a challenge")
        self.state = State.AWAIT_HELLO
        return encode_frame(messages.challenge(self.nonce))

    def send_accept(self, last_seq: int = 0) -> bytes:
        """Accept the hello; ``last_seq``: the highest seq already held for this sender."""
        self._require(State.DECIDE, action="accept")
        assert self.hello is not None
        self.state = State.OPEN
        self._decoder.max_frame_bytes = self.max_frame_bytes
        proof = None
        if self._token and self._cnonce is not None:
            proof = auth.accept_proof(
                self._token, self._cnonce, self.nonce, self.hello.role, self.hello.sender, last_seq
            )
        return encode_frame(messages.accept(last_seq, proof))

    def send_refuse(self, reason: str) -> bytes:
        """Refuse the peer (any time before the accept); close the connection after writing it."""
        self._require(
            State.SEND_CHALLENGE, State.AWAIT_HELLO, State.DECIDE, State.MUST_REFUSE, action="refuse"
        )
        self.state = State.CLOSED
        if self._token and self._token in reason:
            reason = reason.replace(self._token, "<token>")  # a refusal is read by unauthenticated peers
        return encode_frame(messages.refuse(reason))

    def send_control(self, op: str, sender: str, steps: int, request_id: str) -> bytes:
        """A request for the agent ``sender``, to a client whose hello listed the capability."""
        self._require(State.OPEN, action="send a control")
        assert self.hello is not None
        if messages.CAP_CONTROL not in self.hello.caps:
            raise LocalProtocolError("the peer did not list the control capability in its hello")
        try:
            message = messages.validate_control(messages.control(op, sender, steps, request_id))
        except ProtocolError as exc:
            raise LocalProtocolError(f"bad control: {exc}") from None
        return encode_frame(message)

    def send_answer(self, request_id: str, status: str, text: str, sender: str | None = None,
                    session: str | None = None) -> bytes:
        """The answer to a control client's request."""
        self._require(State.OPEN, action="answer")
        assert self.hello is not None
        if self.hello.role != messages.ROLE_CONTROL:
            raise LocalProtocolError("only a control client is answered")
        return encode_frame(messages.answer(request_id, status, text[: messages.MAX_ANSWER_CHARS], sender, session))

    def send_ack(self, seq: int) -> bytes:
        """Acknowledge every batch up to ``seq`` (cumulative)."""
        self._require(State.OPEN, action="ack")
        if not 1 <= seq <= self._received_seq:
            raise LocalProtocolError(f"ack {seq} for a batch not received (highest {self._received_seq})")
        return encode_frame(messages.ack(seq))

    # ------------------------------------------------------------ inbound

    def _decode_limits(self) -> DecodeLimits:
        """A hello is small; an accepted peer's frames are sized for its role."""
        if self.hello is None or self.hello.role == messages.ROLE_CONTROL:
            return SMALL_MESSAGE_LIMITS
        if self.hello.role == messages.ROLE_RELAY:
            return self._rbatch_limits
        return self._batch_limits

    def _oversize_reason(self, exc: FrameTooLarge) -> str:
        if self.state is State.AWAIT_HELLO:
            return f"frame of {exc.declared} bytes before the hello exceeds the pre-hello cap of {exc.cap} bytes"
        return str(exc)

    def _broken(self, reason: str, *, oversize: bool = False, declared: int | None = None) -> Event:
        if self.state is State.AWAIT_HELLO:
            # Refused with the reason, so the peer can tell "wrong version" from network trouble.
            self.state = State.MUST_REFUSE
            return BadHello(reason if oversize else f"bad hello: {reason}", oversize, declared)
        return super()._broken(reason, oversize=oversize, declared=declared)

    def _bad_hello(self, reason: str) -> Event:
        self.state = State.MUST_REFUSE
        return BadHello(reason)

    def _on_message(self, message: dict[str, Any], nbytes: int) -> Event:
        kind = message["t"]
        if self.state is State.AWAIT_HELLO:
            if kind != messages.HELLO:
                return self._bad_hello(f"expected hello, got {kind!r}")
            return self._on_hello(messages.validate_client_message(message))
        assert self.hello is not None  # OPEN
        role = self.hello.role
        if kind == messages.HELLO:
            return self._broken("second hello on an open connection")
        if kind == messages.BATCH and role != messages.ROLE_AGENT:
            return self._broken("only agents send batch")
        if kind == messages.RELAY_BATCH and role != messages.ROLE_RELAY:
            return self._broken("only relays send rbatch")
        if kind == messages.REQUEST and role != messages.ROLE_CONTROL:
            return self._broken("only control clients send request")
        message = messages.validate_client_message(message, self._identities, self._identity_cache_entries)
        if kind == messages.BYE:
            self.state = State.CLOSED
            return Bye()
        if kind == messages.REQUEST:
            return Request(message["op"], message["rank"], message["steps"], message["id"], message.get("session"))
        seq = message["seq"]
        if seq <= self._received_seq:
            return self._broken(f"batch seq {seq} after seq {self._received_seq}: seqs rise on a connection")
        self._received_seq = seq
        if kind == messages.BATCH:
            return Batch(seq, message["body"], nbytes)
        return RelayBatch(
            seq,
            message["items"],
            message["peers"],
            message["node"],
            message["stats"],
            message["sender"],
            message["spool_dropped_upto"],
            nbytes,
        )

    def _on_hello(self, message: dict[str, Any]) -> Event:
        role, sender = message["role"], message["sender"]
        if role not in self.roles:
            return self._bad_hello(f"role {role!r} may not connect here")
        if not auth.verify_hello_mac(self._token, self.nonce, role, sender, message["mac"]):
            return self._bad_hello("bad token (hello MAC does not verify)")
        self.state = State.DECIDE
        self._cnonce = message.get("cnonce")
        self.hello = Hello(role, sender, message["session"], message["identity"], message["caps"])
        return self.hello


class ClientConnection(_Connection):
    """The client's side (agent to relay or daemon, relay to daemon)."""

    def __init__(
        self, token: str | None, *, max_frame_bytes: int = MAX_HELLO_FRAME_BYTES, cnonce: bytes | None = None
    ) -> None:
        # Every server message is small (challenge, accept, refuse, ack): one cap throughout.
        super().__init__(State.AWAIT_CHALLENGE, max_frame_bytes)
        self._token = token
        self.cnonce = cnonce if cnonce is not None else auth.new_nonce()
        self._snonce = b""
        self.role = ""
        self.sender = ""
        self.last_seq = 0  # accept.last_seq
        self.verified = False
        self._sent_seq = 0  # highest batch seq sent, or last_seq before any
        self.caps: frozenset[str] = frozenset()  # what this side listed in its hello

    # ----------------------------------------------------------- outbound

    def send_hello(
        self, *, role: str, sender: str, session: str, identity: dict[str, Any], caps: tuple[str, ...] = ()
    ) -> bytes:
        """``caps``: what this client can be sent besides acks (``messages.CAP_CONTROL``)."""
        self._require(State.SEND_HELLO, action="send a hello")
        if role not in messages.ROLES:
            raise LocalProtocolError(f"unknown role {role!r}")
        unknown = set(caps) - messages.KNOWN_CAPS
        if unknown:
            raise LocalProtocolError(f"unknown capabilities {sorted(unknown)}")
        self.state = State.AWAIT_ACCEPT
        self.role, self.sender, self.caps = role, sender, frozenset(caps)
        mac = auth.hello_mac(self._token, self._snonce, role, sender)
        return encode_frame(
            messages.hello(role=role, sender=sender, session=session, identity=identity, mac=mac, cnonce=self.cnonce,
                           caps=tuple(caps))
        )

    def send_batch(self, seq: int, body: bytes) -> bytes:
        """An agent's numbered batch."""
        self._numbered(seq, messages.ROLE_AGENT)
        return encode_frame(messages.batch(seq, body))

    def send_rbatch(
        self,
        seq: int,
        items: list[list[Any]],
        peers: dict[str, dict[str, Any]],
        node: dict[str, Any],
        stats: dict[str, int],
        sender: str | None = None,
        spool_dropped_upto: int = 0,
    ) -> bytes:
        """A relay's numbered rbatch."""
        self._numbered(seq, messages.ROLE_RELAY)
        return encode_frame(messages.relay_batch(seq, items, peers, node, stats, sender, spool_dropped_upto))

    def send_encoded(self, seq: int, frame: bytes) -> bytes:
        """A batch (or rbatch, for a relay) framed earlier: resend buffers keep frames,
        not messages. The caller vouches that ``frame`` holds that kind with ``seq``."""
        self._numbered(seq, self.role)
        return frame

    def send_request(self, op: str, rank: int, steps: int, request_id: str, session: str | None = None) -> bytes:
        """A control client's request (role control only)."""
        self._require(State.OPEN, action="send a request")
        if self.role != messages.ROLE_CONTROL:
            raise LocalProtocolError(f"a {self.role} does not send requests")
        message = messages.request(op, rank, steps, request_id, session)
        try:
            messages.validate_request(dict(message))
        except ProtocolError as exc:
            raise LocalProtocolError(f"bad request: {exc}") from None
        return encode_frame(message)

    def send_bye(self) -> bytes:
        self._require(State.OPEN, action="say bye")
        self.state = State.CLOSED
        return encode_frame(messages.bye())

    def _numbered(self, seq: int, role: str) -> None:
        self._require(State.OPEN, action="send a batch")
        if role != self.role:
            raise LocalProtocolError(f"a {self.role} does not send what a {role} sends")
        if seq <= self._sent_seq:
            raise LocalProtocolError(f"batch seq {seq} not above {self._sent_seq}: seqs rise on a connection")
        self._sent_seq = seq

    # ------------------------------------------------------------ inbound

    def _on_message(self, message: dict[str, Any], nbytes: int) -> Event:
        if message["t"] == messages.CONTROL:
            return self._on_control(message)
        message = messages.validate_server_message(message)
        kind = message["t"]
        if kind == messages.REFUSE:
            self.state = State.CLOSED
            return Refused(message["reason"])
        if self.state is State.AWAIT_CHALLENGE:
            if kind != messages.CHALLENGE:
                return self._broken(f"expected challenge, got {kind!r}")
            self._snonce = message["nonce"]
            self.state = State.SEND_HELLO
            return Challenge(self._snonce)
        if self.state is State.SEND_HELLO:
            return self._broken(f"{kind!r} before the hello was sent")
        if self.state is State.AWAIT_ACCEPT:
            if kind != messages.ACCEPT:
                return self._broken(f"expected accept, got {kind!r}")
            return self._on_accept(message)
        if kind == messages.ANSWER and self.role == messages.ROLE_CONTROL:
            return Answer(message["id"], message["status"], message["message"], message["sender"], message["session"])
        if kind != messages.ACK:  # OPEN
            return self._broken(f"unexpected {kind!r} after accept")
        seq = message["seq"]
        if seq > self._sent_seq:
            return self._broken(f"ack {seq} for a batch never sent (highest {self._sent_seq})")
        return Ack(seq)

    def _on_control(self, message: dict[str, Any]) -> Event:
        if self.state is not State.OPEN or messages.CAP_CONTROL not in self.caps:
            return self._broken("control from a server this client did not offer the capability to")
        try:
            clean = messages.validate_control(message)
        except ProtocolError as exc:
            return ControlRefused(str(exc))  # one bad request; the telemetry stream goes on
        return Control(clean["op"], clean["sender"], clean["steps"], clean["id"])

    def _on_accept(self, message: dict[str, Any]) -> Event:
        last_seq = message["last_seq"]
        if self._token:
            proof = message.get("proof")
            if proof is None:
                self.state = State.FAILED
                return Unverified("its accept carries no proof")
            if not auth.verify_accept_proof(
                self._token, self.cnonce, self._snonce, self.role, self.sender, last_seq, proof
            ):
                self.state = State.FAILED
                return Unverified("its proof does not verify")
        self.state = State.OPEN
        self.last_seq = last_seq = max(0, last_seq)
        self._sent_seq = last_seq
        self.verified = bool(self._token)
        return Accepted(last_seq, self.verified)
