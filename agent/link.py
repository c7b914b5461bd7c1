"""The agent's connection to its relay: a blocking socket under the conversation.

``traceml_wire.client_connection.ClientConnection`` holds the whole conversation
(challenge, hello, accept with the relay's proof of the token, acks, bye);
this is only its I/O: a socket with timeouts on the sender thread (no asyncio
in the training process).
"""

from __future__ import annotations

import select
import socket
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from traceml_wire import connection_events as conv
from traceml_wire import messages
from traceml_wire.client_connection import ClientConnection
from traceml_wire.connection import State
from traceml_wire.errors import ProtocolError
from traceml_wire.limits import set_keepalive

# Control requests held between two reads of the sender loop; more are dropped (counted).
MAX_CONTROLS = 8
CONNECT_TIMEOUT_S = 1.0  # loopback: a healthy relay answers in microseconds
IO_TIMEOUT_S = 2.0
# TCP keepalive (idle, interval, count), as the servers set it on their side: an agent
# may talk to a daemon on another host, and a vanished one must not hold its link.
KEEPALIVE = (60, 10, 6)


class Refused(Exception):
    """The relay answered the hello with refuse."""


class Unverified(Exception):
    """What answered on the relay port could not prove it holds the token."""


class Cancelled(TimeoutError):
    """A handshake given up because the sender is stopping (not a relay fault)."""


@dataclass(frozen=True)
class HelloInfo:
    sender: str
    session: str
    identity: dict[str, Any]


class Link:
    """One authenticated connection to the relay: a blocking socket under a
    ``ClientConnection``, which holds the whole conversation."""

    def __init__(self, sock: socket.socket, conn: ClientConnection, cancel: Callable[[], bool]) -> None:
        self.sock = sock
        self.conn = conn
        self._cancel = cancel
        self.io_timeout = IO_TIMEOUT_S
        # Requests the relay passed down (conv.Control), taken by the sender loop.
        self.controls: deque[conv.Control] = deque()
        self.controls_refused = 0  # malformed ones and those past MAX_CONTROLS

    @classmethod
    def open(
        cls,
        host: str,
        port: int,
        *,
        token: str | None,
        hello: HelloInfo,
        timeout: float,
        cancel: Callable[[], bool] = lambda: False,
    ) -> tuple[Link, int]:
        """Connect and run the handshake; return the link and accept.last_seq.

        ``cancel`` is polled while waiting, so shutdown is never stuck behind
        a relay that accepted the TCP connection but does not answer.
        """
        sock = socket.create_connection((host, port), timeout=min(timeout, CONNECT_TIMEOUT_S))
        link = cls(sock, ClientConnection(token), cancel)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            set_keepalive(sock, KEEPALIVE)
            deadline = time.monotonic() + timeout
            while True:
                for event in link._events(deadline):
                    if isinstance(event, conv.Challenge):
                        link.send(link.conn.send_hello(role=messages.ROLE_AGENT, sender=hello.sender,
                                                       session=hello.session, identity=hello.identity,
                                                       caps=(messages.CAP_CONTROL,)))
                    elif isinstance(event, conv.Accepted):
                        return link, event.last_seq  # nothing follows an accept until we send
                    else:
                        link._fail(event)
        except BaseException:
            link.close(bye=False)
            raise

    def _events(self, deadline: float) -> list[conv.Event]:
        """The next server events, waiting at most until ``deadline``."""
        while True:
            if self._cancel():
                raise Cancelled("sender stopping")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("relay did not answer in time")
            self.sock.settimeout(min(remaining, 0.05))
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            if not data:
                raise ConnectionError("relay closed the connection")
            events = self.conn.receive_data(data)
            if events:
                return events

    @staticmethod
    def _fail(event: conv.Event) -> NoReturn:
        if isinstance(event, conv.Refused):
            raise Refused(event.reason)
        if isinstance(event, conv.Unverified):
            raise Unverified(event.reason)
        raise ProtocolError(getattr(event, "reason", f"unexpected {type(event).__name__}"))

    def send(self, frame: bytes) -> None:
        self.sock.settimeout(self.io_timeout)
        self.sock.sendall(frame)

    def read_acks(self, wait: float) -> int:
        """Highest ack that arrived within ``wait`` seconds (0 if none).

        Raises ConnectionError when the relay closed, Refused when it refused and
        ProtocolError when it broke the protocol mid-stream.
        """
        best = 0
        deadline = time.monotonic() + wait
        while True:
            remaining = max(0.0, deadline - time.monotonic())
            readable, _, _ = select.select([self.sock], [], [], remaining)
            if not readable:
                return best
            self.sock.settimeout(self.io_timeout)
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("relay closed the connection")
            for event in self.conn.receive_data(data):
                if isinstance(event, conv.Control):
                    if len(self.controls) < MAX_CONTROLS:
                        self.controls.append(event)
                    else:
                        self.controls_refused += 1
                    continue
                if isinstance(event, conv.ControlRefused):
                    self.controls_refused += 1
                    continue
                if not isinstance(event, conv.Ack):
                    self._fail(event)
                best = max(best, event.seq)
            if best and time.monotonic() >= deadline:
                return best

    def close(self, bye: bool) -> None:
        if bye and self.conn.state is State.OPEN:
            try:
                self.sock.settimeout(0.2)
                self.sock.sendall(self.conn.send_bye())
            except OSError:
                pass
        try:
            self.sock.close()
        except OSError:
            pass
