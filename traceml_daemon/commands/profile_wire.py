"""`traceml-daemon profile --daemon HOST:PORT`: the request over the daemon's own port.

A one-shot client of role ``control`` (traceml_wire.client_connection): the same
challenge, hello MAC and accept proof as every relay and agent, so with a token
both sides prove they hold it; then one ``request`` and the daemon's ``answer``,
and a bye. A daemon older than the control role refuses the hello; the message
says so.
"""

from __future__ import annotations

import socket
import ssl
import time

from traceml_wire import connection_events as conv
from traceml_wire import messages
from traceml_wire.client_connection import ClientConnection

TIMEOUT_S = 5.0


class WireError(Exception):
    """The daemon could not be asked; the message says why and what to do."""


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise WireError(f"--daemon {text!r}: give HOST:PORT, e.g. 127.0.0.1:29765")
    return host.strip("[]"), int(port)


def ask(address: str, token: str | None, rank: int, steps: int, request_id: str, session: str | None,
        tls_ca: str | None = None, timeout: float = TIMEOUT_S) -> conv.Answer:
    """Send one profile request to the daemon at ``address``; its answer. Raises WireError."""
    host, port = parse_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise WireError(f"daemon not reachable at {host}:{port} ({exc.strerror or exc}): is `traceml-daemon serve` "
                        "running there, on that port?") from None
    try:
        if tls_ca:
            sock = ssl.create_default_context(cafile=tls_ca).wrap_socket(sock, server_hostname=host)
        return _converse(sock, ClientConnection(token), rank, steps, request_id, session, f"{host}:{port}",
                         time.monotonic() + timeout)
    except (OSError, ssl.SSLError) as exc:
        raise WireError(f"lost the daemon at {host}:{port} ({exc}); check --tls-ca against its --tls-cert") from None
    finally:
        sock.close()


def _converse(sock: socket.socket, conn: ClientConnection, rank: int, steps: int, request_id: str,
              session: str | None, where: str, deadline: float) -> conv.Answer:
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise WireError(f"the daemon at {where} did not answer in time")
        sock.settimeout(remaining)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        if not data:
            raise WireError(f"the daemon at {where} closed the connection")
        for event in conn.receive_data(data):
            if isinstance(event, conv.Challenge):
                sock.sendall(conn.send_hello(role=messages.ROLE_CONTROL, sender=f"control/{request_id}", session="",
                                             identity={}))
            elif isinstance(event, conv.Accepted):
                sock.sendall(conn.send_request(messages.OP_PROFILE, rank, steps, request_id, session))
            elif isinstance(event, conv.Answer):
                sock.sendall(conn.send_bye())
                return event
            else:
                raise WireError(_failure(event, where))


def _failure(event: conv.Event, where: str) -> str:
    if isinstance(event, conv.Refused):
        if "role" in event.reason:
            return (f"the daemon at {where} does not take requests ({event.reason}): it is older than this "
                    "command; upgrade it, or use --db on its host")
        hint = "; check that both hold the same TRACEML_TOKEN (--token-file)" if "token" in event.reason else ""
        return f"the daemon at {where} refused: {event.reason}{hint}"
    if isinstance(event, conv.Unverified):
        return f"what answered at {where} did not prove it holds the token ({event.reason}); nothing was asked"
    return f"the daemon at {where} broke the protocol: {getattr(event, 'reason', type(event).__name__)}"
