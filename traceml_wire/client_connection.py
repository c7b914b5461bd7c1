"""The client's side of the conversation (agent to relay or daemon, relay to
daemon, a control client to the daemon): the hello, the check of the server's
proof, numbered batches out and acks, control requests and answers in.
Sans-I/O, like ``traceml_wire.connection``, whose overview draws the whole
conversation.
"""

from __future__ import annotations

from typing import Any

from traceml_wire import auth, messages
from traceml_wire.connection import Connection, LocalProtocolError, State
from traceml_wire.connection_events import (
    Accepted,
    Ack,
    Answer,
    Challenge,
    Control,
    ControlRefused,
    Event,
    Refused,
    Unverified,
)
from traceml_wire.errors import ProtocolError
from traceml_wire.framing import MAX_HELLO_FRAME_BYTES, encode_frame


class ClientConnection(Connection):
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
