"""The conversation of one connection, written once: sans-I/O state machines.

In the manner of h11's ``Connection``: nothing here touches a socket. A shell
feeds the bytes it read to ``receive_data(data)`` and acts on the events it
gets back; it asks the connection for the bytes of what it wants to say
(``send_hello``, ``send_batch``, ``send_accept``, ``send_ack`` ...) and writes
them. The agent's sender, both sides of the relay and the daemon are such
shells; the wire itself is described in ``traceml_wire.messages``.

This module holds what both sides share: the states, the misuse error and
the reading of frames into events. The sides are
``traceml_wire.server_connection.ServerConnection`` and
``traceml_wire.client_connection.ClientConnection``; the events they return
are in ``traceml_wire.connection_events``.

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
from typing import Any

from traceml_wire.connection_events import Event, ProtocolFailure
from traceml_wire.errors import FrameTooLarge, ProtocolError
from traceml_wire.framing import SMALL_MESSAGE_LIMITS, DecodeLimits, FrameDecoder, unpack_message


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


# States in which frames are not taken from the decoder.
_NOT_READING = frozenset({State.SEND_CHALLENGE, State.DECIDE, State.MUST_REFUSE, State.CLOSED, State.FAILED})


class Connection:
    """What both sides share: the state, the frame decoder and the read loop; each
    side says what a message means in its state (``_on_message``)."""

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
