"""The server's side of the conversation (relay for agents, daemon for relays,
agents and control clients): challenge, decide on the hello, numbered batches
in, cumulative acks and control requests out. Sans-I/O, like
``traceml_wire.connection``, whose overview draws the whole conversation.

Frame caps per state: a server reads frames of at most ``MAX_HELLO_FRAME_BYTES``
until it accepted the hello, then ``max_frame_bytes``; what a frame may decode
into (``framing.DecodeLimits``) is sized the same way: small for a hello and
for everything a server says, for a batch or an rbatch by the peer's role. Once a hello arrived the
server reads nothing more until the shell accepted or refused it; bytes the
peer sent behind its hello wait in the decoder, and the shell calls
``receive_data(b"")`` after ``send_accept`` to take them.
"""

from __future__ import annotations

from typing import Any

from traceml_wire import auth, messages
from traceml_wire.connection import Connection, LocalProtocolError, State
from traceml_wire.connection_events import BadHello, Batch, Bye, Event, Hello, RelayBatch, Request
from traceml_wire.errors import FrameTooLarge, ProtocolError
from traceml_wire.framing import (
    DEFAULT_MAX_FRAME_BYTES,
    MAX_HELLO_FRAME_BYTES,
    SMALL_MESSAGE_LIMITS,
    DecodeLimits,
    batch_limits,
    encode_frame,
    rbatch_limits,
)


class ServerConnection(Connection):
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
