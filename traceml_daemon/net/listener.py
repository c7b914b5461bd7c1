"""The daemon's listening socket: plaintext through ``asyncio.start_server``, TLS
through ``TLSListener``, which accepts the sockets itself."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
from collections.abc import Callable
from typing import Any

log = logging.getLogger("traceml_daemon.net.server")


class TLSListener:
    """The listening socket of a TLS daemon, with the ``asyncio.Server`` surface
    ``serve`` uses (``sockets``, ``start_serving``, ``close``, ``async with``).

    It accepts connections itself and hands each raw socket to ``on_accept``,
    which runs the handshake with ``loop.connect_accepted_socket``: a failed or
    stalled handshake then raises where the peer's address is known, so it can
    be logged with its reason. ``asyncio.start_server(ssl=...)`` drops those
    without a word, and upgrading each connection with ``start_tls`` loses the
    ClientHello on uvloop, which reads before the handler can pause the socket.
    """

    def __init__(self, sock: socket.socket, on_accept: Callable[[socket.socket, Any], None]) -> None:
        self.sockets = [sock]
        self._on_accept = on_accept
        self._task: asyncio.Task[None] | None = None

    async def start_serving(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._accept_forever())

    async def _accept_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, addr = await loop.sock_accept(self.sockets[0])
            except OSError as exc:
                # Out of file descriptors and the like: keep listening, without spinning.
                log.warning("accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            self._on_accept(conn, addr)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.sockets[0].close()

    async def __aenter__(self) -> TLSListener:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


async def listen_tls(host: str, port: int, backlog: int, on_accept: Callable[[socket.socket, Any], None]) -> TLSListener:
    """Bind ``host:port`` for a TLS daemon (raises OSError when it cannot)."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sock = socket.create_server((host, port), family=infos[0][0], backlog=backlog)
    sock.setblocking(False)
    return TLSListener(sock, on_accept)


def listening_port(server: asyncio.Server | TLSListener) -> int:
    """The port ``server`` listens on. uvloop binds in create_server but listens in
    start_serving, and a listen that fails there (another process began listening on
    the port in between) only closes the socket, leaving None in ``sockets``."""
    sockets = server.sockets
    if not sockets or sockets[0] is None:
        raise OSError(errno.EADDRINUSE, "the port was bound but could not be listened on; is another process "
                      "listening on it? Choose another --port")
    return int(sockets[0].getsockname()[1])


def address_of(peer: object) -> tuple[str, str]:
    """``(host, "host:port")`` of a peer address as asyncio reports it."""
    if isinstance(peer, tuple) and len(peer) >= 2:
        return str(peer[0]), f"{peer[0]}:{peer[1]}"
    return str(peer), str(peer)
