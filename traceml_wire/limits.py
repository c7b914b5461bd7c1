"""Connection limits of a server (relay or daemon), and who gets a connection slot.

Sans-I/O like the rest of ``traceml_wire``: ``ConnectionLimits`` is the one set
of numbers a server's shell enforces (each side declares its own defaults:
``traceml_daemon.net.limits.DAEMON_LIMITS``, ``relay.limits.RELAY_LIMITS``);
``ConnectionGate`` is the bookkeeping of its connections, with the clock and
the closing left to the shell.

A peer is *unauthenticated* from its TCP accept (its TLS handshake included)
until its hello is accepted, then *authenticated*. The two have separate caps,
so sockets that never say a hello cannot take the slots of peers that hold the
token; and a newcomer that finds an unauthenticated cap full (in total, or for
its source address) takes the slot of the oldest unauthenticated peer in that
scope. A real peer says its hello within a round trip, so only a flood that
fills every slot faster than that could cut one off; silent and trickling
sockets, however many and however often renewed, keep nobody out. Refusing the
newcomer instead would let a steady stream of fresh idle sockets lock a relay
out for good.
"""

from __future__ import annotations

import socket
from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

H = TypeVar("H")


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """What one server allows its peers; every field a bound on time, slots or bytes."""

    max_connections: int  # authenticated peers at once; one more is refused
    max_unauthenticated: int  # peers in their TLS handshake or before their hello is accepted
    max_unauthenticated_per_address: int  # of those, from one source address
    hello_timeout: float  # for the TLS handshake, then again for the hello
    read_timeout: float  # for a frame's body, from the moment its bytes are reserved
    idle_timeout: float  # between frames of an authenticated peer
    inbound_bytes: int  # frames being read, all connections together (ByteBudget)
    keepalive_idle: int  # TCP keepalive: seconds of silence before the first probe
    keepalive_interval: int  # seconds between probes
    keepalive_count: int  # unanswered probes before the kernel drops the connection

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_unauthenticated", "max_unauthenticated_per_address", "inbound_bytes",
                     "keepalive_idle", "keepalive_interval", "keepalive_count"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        for name in ("hello_timeout", "read_timeout", "idle_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be above 0")

    @property
    def keepalive(self) -> tuple[int, int, int]:
        """``(idle, interval, count)`` for ``set_keepalive``."""
        return self.keepalive_idle, self.keepalive_interval, self.keepalive_count


def keepalive_options(idle: int, interval: int, count: int) -> list[tuple[int, int, int]]:
    """``setsockopt`` arguments that turn TCP keepalive on: first probe after ``idle``
    seconds of silence, then every ``interval``, the link dropped after ``count``
    unanswered; each timing option where the platform has it (macOS names the
    idle time TCP_KEEPALIVE)."""
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    idle_option = getattr(socket, "TCP_KEEPIDLE", None) or getattr(socket, "TCP_KEEPALIVE", None)
    for option, value in (
        (idle_option, idle),
        (getattr(socket, "TCP_KEEPINTVL", None), interval),
        (getattr(socket, "TCP_KEEPCNT", None), count),
    ):
        if option is not None:
            options.append((socket.IPPROTO_TCP, option, value))
    return options


def set_keepalive(sock: object, keepalive: tuple[int, int, int]) -> None:
    """Apply ``keepalive_options(*keepalive)`` to ``sock`` (a socket, or asyncio's view
    of one). Best effort: a socket that is not TCP, or already closed, stays as it is."""
    setsockopt = getattr(sock, "setsockopt", None)
    if setsockopt is None:
        return
    for level, option, value in keepalive_options(*keepalive):
        try:
            setsockopt(level, option, value)
        except OSError:
            return


@dataclass(frozen=True, slots=True)
class Admission(Generic[H]):
    """``admitted``: the newcomer may converse; else ``reason`` says why not (the
    authenticated slots are all taken). ``evict``: unauthenticated peers that lost
    their slot to it; the shell closes them."""

    admitted: bool
    reason: str = ""
    evict: tuple[H, ...] = ()


class ConnectionGate(Generic[H]):
    """The connection slots of one server. ``H`` is whatever the shell uses to close
    a peer (its task, its transport). Every peer is ``admit``-ted when it connects,
    ``authenticate``-d when its hello is to be accepted and ``release``-d when it
    ends, whatever happened in between (an evicted peer's release does nothing)."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self._pending: OrderedDict[H, str] = OrderedDict()  # unauthenticated peer -> its address, oldest first
        self._per_address: dict[str, int] = {}
        self._authenticated: set[H] = set()
        self.evicted = 0
        self.refused = 0

    @property
    def unauthenticated(self) -> int:
        return len(self._pending)

    @property
    def authenticated(self) -> int:
        return len(self._authenticated)

    def __len__(self) -> int:
        return len(self._pending) + len(self._authenticated)

    def admit(self, handle: H, address: str) -> Admission[H]:
        """A new connection from ``address``."""
        limits = self.limits
        if len(self._authenticated) >= limits.max_connections:
            # No slot would be free for it after its hello: refused before it costs one.
            self.refused += 1
            return Admission(False, "too many connections")
        evict: list[H] = []
        if self._per_address.get(address, 0) >= limits.max_unauthenticated_per_address:
            evict.append(self._oldest(address))
            self._forget(evict[-1])
        if len(self._pending) >= limits.max_unauthenticated:
            evict.append(self._oldest(None))
            self._forget(evict[-1])
        self._pending[handle] = address
        self._per_address[address] = self._per_address.get(address, 0) + 1
        self.evicted += len(evict)
        return Admission(True, "", tuple(evict))

    def authenticate(self, handle: H) -> str | None:
        """Move an admitted peer whose hello is good to the authenticated; None when
        it may be accepted, else the reason to refuse it (the cap is full, or it was
        evicted while its hello was on the way)."""
        if handle not in self._pending:
            return "connection slot given to a newer peer"
        if len(self._authenticated) >= self.limits.max_connections:
            self.refused += 1
            return "too many connections"
        self._forget(handle)
        self._authenticated.add(handle)
        return None

    def release(self, handle: H) -> None:
        """The connection ended."""
        if handle in self._pending:
            self._forget(handle)
        self._authenticated.discard(handle)

    def _oldest(self, address: str | None) -> H:
        """The unauthenticated peer that has waited longest (from ``address`` when given)."""
        for handle, where in self._pending.items():
            if address is None or where == address:
                return handle
        raise LookupError(address)  # only asked for a scope that is full

    def _forget(self, handle: H) -> None:
        address = self._pending.pop(handle)
        count = self._per_address[address] - 1
        if count:
            self._per_address[address] = count
        else:
            del self._per_address[address]
