"""Which open connection carries which agent: where a control request goes.

A relay's rbatches name every agent sender they carry (``peers``: sender ->
identity); an agent talking to the daemon directly is its own. The handler
tells ``ControlRoutes`` what each batch named (``saw``), per connection, and
forgets a connection when it closes. ``send`` then writes a ``control`` frame
on the one connection that carries the rank asked, and only on a connection
whose hello listed the control capability (an older relay or agent never gets
a message it does not know). Event loop thread only: no locks.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from traceml_wire import connection_events as conv
from traceml_wire import messages
from traceml_wire.connection import State
from traceml_wire.server_connection import ServerConnection

# Agent senders remembered per connection: a relay cycling through sender ids costs a
# missing route for the newest (refused, said by the CLI), never memory.
MAX_SENDERS_PER_CONNECTION = 65_536


@dataclass(eq=False)
class RoutedConnection:
    """One open connection that can take control requests, and the agents it carries."""

    conn: ServerConnection
    writer: asyncio.StreamWriter
    senders: dict[str, dict[str, Any]] = field(default_factory=dict)  # agent sender -> identity


@dataclass(frozen=True)
class Sent:
    sender: str
    session: str


class RouteError(Exception):
    """The request could not go anywhere; the message says why and what to do."""


class ControlRoutes:
    def __init__(self) -> None:
        self._by_sender: dict[str, RoutedConnection] = {}
        self.senders_refused = 0  # past MAX_SENDERS_PER_CONNECTION

    def open(self, hello: conv.Hello, conn: ServerConnection, writer: asyncio.StreamWriter) -> RoutedConnection | None:
        """The route of a newly accepted connection; None when its peer cannot take control requests."""
        if messages.CAP_CONTROL not in hello.caps:
            return None
        return RoutedConnection(conn, writer)

    def saw(self, route: RoutedConnection, peers: dict[str, dict[str, Any]]) -> None:
        """A batch on ``route`` carried these agent senders (the newest connection wins)."""
        by_sender = self._by_sender
        for sender, identity in peers.items():
            if by_sender.get(sender) is not route or route.senders.get(sender) is not identity:
                if sender not in route.senders and len(route.senders) >= MAX_SENDERS_PER_CONNECTION:
                    self.senders_refused += 1
                    continue
                by_sender[sender] = route
                route.senders[sender] = identity

    def close(self, route: RoutedConnection) -> None:
        for sender in route.senders:
            if self._by_sender.get(sender) is route:
                del self._by_sender[sender]
        route.senders.clear()

    def ranks(self, session: str | None) -> dict[str, list[int]]:
        """Session -> the global ranks connected now (what an error names)."""
        out: dict[str, list[int]] = {}
        for sender, route in self._by_sender.items():
            identity = route.senders.get(sender, {})
            if session is None or identity.get("session") == session:
                rank = identity.get("global_rank")
                if isinstance(rank, int):
                    out.setdefault(str(identity.get("session")), []).append(rank)
        return out

    def send(self, session: str | None, rank: int, steps: int, request_id: str) -> Sent:
        """Write a profile request on the connection that carries ``rank`` of ``session``
        (None: the one session that has that rank connected). Raises RouteError."""
        found = [
            (sender, route, identity)
            for sender, route in self._by_sender.items()
            if (identity := route.senders.get(sender, {})).get("global_rank") == rank
            and (session is None or identity.get("session") == session)
        ]
        if not found:
            connected = self.ranks(session)
            where = f"session {session}" if session is not None else "any session"
            listing = "; ".join(f"session {s}: ranks {sorted(r)}" for s, r in sorted(connected.items())) or "none"
            raise RouteError(
                f"rank {rank} of {where} is not connected to this daemon (connected now: {listing}); "
                "pick a rank of a running job, or the job finished"
            )
        sessions = {str(identity.get("session")) for _, _, identity in found}
        if len(sessions) > 1:
            raise RouteError(f"rank {rank} is connected in several sessions ({', '.join(sorted(sessions))}): "
                             "say which with --session")
        # Several senders for one rank: a restarted rank reconnected; the newest connection is last.
        sender, route, identity = found[-1]
        if route.conn.state is not State.OPEN or route.writer.is_closing():
            raise RouteError(f"the connection that carries rank {rank} is closing; try again in a few seconds")
        route.writer.write(route.conn.send_control(messages.OP_PROFILE, sender, steps, request_id))
        return Sent(sender, str(identity.get("session")))
