"""Test doubles for the relay: a fake daemon and a minimal agent, both on real
sockets and the real wire framing (no relay code is reused here)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any

from traceml_wire import FrameDecoder, encode_frame, unpack_message
from traceml_wire import messages as wm
from traceml_wire.auth import accept_proof, hello_mac, new_nonce, verify_accept_proof, verify_hello_mac


async def read_message(reader: asyncio.StreamReader, decoder: FrameDecoder, ready: list[bytes]) -> dict[str, Any]:
    while not ready:
        data = await reader.read(65536)
        if not data:
            raise ConnectionResetError("closed")
        ready.extend(decoder.feed(data))
    return unpack_message(ready.pop(0))


class FakeDaemon:
    """Speaks the server side of the conversation to relays and records rbatches.

    ``withhold_acks`` stops acking (rbatches stay unacked in the relay);
    ``drop()`` cuts every open connection, as a daemon restart would;
    ``squat`` accepts every hello without checking it and sends ``squat_proof``
    (None: no proof) instead of a proof of the token, as a process that took the
    daemon's port without the token would.
    """

    def __init__(self, token: str | None = None) -> None:
        self.token = token
        self.rbatches: list[dict[str, Any]] = []
        self.hellos: list[dict[str, Any]] = []
        self.withhold_acks = False
        self.refuse: str | None = None
        self.squat = False
        self.squat_proof: bytes | None = None
        self.connections = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self.port = 0
        self.got_rbatch = asyncio.Event()

    async def start(self, port: int = 0) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self.drop()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def drop(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        decoder, ready = FrameDecoder(), []
        try:
            nonce = new_nonce()
            writer.write(encode_frame(wm.challenge(nonce)))
            hello = wm.validate_client_message(await read_message(reader, decoder, ready))
            self.hellos.append(hello)
            good_mac = verify_hello_mac(self.token, nonce, hello["role"], hello["sender"], hello["mac"])
            if not self.squat and (self.refuse or not good_mac):
                writer.write(encode_frame(wm.refuse(self.refuse or "bad token")))
                await writer.drain()
                return
            self.connections += 1
            proof = self.squat_proof
            if not self.squat and self.token and "cnonce" in hello:
                proof = accept_proof(self.token, hello["cnonce"], nonce, hello["role"], hello["sender"], 0)
            writer.write(encode_frame(wm.accept(0, proof)))
            while True:
                msg = wm.validate_client_message(await read_message(reader, decoder, ready))
                if msg["t"] == wm.BYE:
                    return
                self.rbatches.append(msg)
                self.got_rbatch.set()
                if not self.withhold_acks:
                    writer.write(encode_frame(wm.ack(msg["seq"])))
                    await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    def items(self) -> list[tuple[str, int, bytes]]:
        """Every item received, deduplicated by (sender, seq) like the daemon does."""
        high: dict[str, int] = {}
        out = []
        for rb in self.rbatches:
            for sender, seq, body in rb["items"]:
                if seq > high.get(sender, 0):
                    high[sender] = seq
                    out.append((sender, seq, body))
        return out


class FakeAgent:
    """The client side: hello, numbered batches, reading acks."""

    def __init__(self, port: int, token: str | None, sender: str = "s/a0/n0/r0/1-aa", identity: dict[str, Any] | None = None) -> None:
        self.port = port
        self.token = token
        self.sender = sender
        self.identity = identity if identity is not None else {"global_rank": 0, "local_rank": 0, "node_rank": 0}
        self.reader: asyncio.StreamReader
        self.writer: asyncio.StreamWriter
        self._decoder, self._ready = FrameDecoder(), []  # type: ignore[var-annotated]

    async def connect(self, role: str = "agent") -> dict[str, Any]:
        """Hello on a fresh connection; the reply. An accept must prove the token (when set)."""
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        challenge = await self.read()
        mac = hello_mac(self.token, challenge["nonce"], role, self.sender)
        cnonce = new_nonce()
        self.send(wm.hello(role=role, sender=self.sender, session="s", identity=self.identity, mac=mac, cnonce=cnonce))
        reply = await self.read()
        if reply["t"] == "accept" and self.token:
            assert verify_accept_proof(self.token, cnonce, challenge["nonce"], role, self.sender, reply["last_seq"],
                                       reply.get("proof")), "the relay's accept does not prove the token"
        return reply

    async def read(self) -> dict[str, Any]:
        return await read_message(self.reader, self._decoder, self._ready)

    def send(self, message: dict[str, Any] | bytes) -> None:
        self.writer.write(encode_frame(message))

    async def send_batches(self, seqs: range, body: Callable[[int], bytes]) -> list[int]:
        for seq in seqs:
            self.send(wm.batch(seq, body(seq)))
        return [(await self.read())["seq"] for _ in seqs]

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionError, OSError):
            pass


async def eventually(check: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll a condition; the timeout only bounds a hang, it is not a performance assertion."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        if loop.time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.02)


def body_for(sender: str) -> Callable[[int], bytes]:
    """Distinct opaque bodies (not valid tables on purpose: the relay must not look)."""
    return lambda seq: f"{sender}|{seq}|".encode() + os.urandom(8)


def run(coro_fn: Callable[..., Awaitable[None]]) -> Callable[..., None]:
    """Run an async test body on a fresh loop (no pytest-asyncio needed)."""
    import functools

    @functools.wraps(coro_fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        asyncio.run(asyncio.wait_for(coro_fn(*args, **kwargs), 60))  # type: ignore[arg-type]

    return wrapper
