"""A tiny real relay for agent tests: real sockets, real wire framing.

It speaks the server side of the handshake (challenge, verify the hello MAC,
accept with the held high-water mark and, holding a token, the proof of it,
or refuse) and acks batches, with knobs to misbehave: hang up before the
challenge, drop the connection after N batches without acking, never answer
at all, accept without proving the token (a squatter on the relay port).
It is written on the raw wire on purpose, apart from traceml_wire.server_connection.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from traceml_wire import messages
from traceml_wire.auth import accept_proof, new_nonce, verify_hello_mac
from traceml_wire.framing import FrameDecoder, encode_frame, unpack_message


class FakeRelay:
    def __init__(self, *, token: str | None = None) -> None:
        self.token = token
        self.mode = "normal"  # normal | hangup | silent | refuse | squat
        self.refuse_reason = "go away"
        self.squat_proof: bytes | None = b"\x00" * 32  # what a squatter puts as its proof (None: no proof)
        self.ack = True
        self.drop_after: int | None = None  # close after this many batches, unacked
        self.hellos: list[dict[str, Any]] = []
        self.batches: list[tuple[int, int, bytes]] = []  # (connection no, seq, body)
        self.held: dict[str, int] = {}
        self.connections = 0
        self.byes = 0
        self._cond = threading.Condition()
        self._server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(16)
        self.port: int = self._server.getsockname()[1]
        self._closed = False
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            with self._cond:
                self.connections += 1
                number = self.connections
                self._conns.append(conn)
                self._cond.notify_all()
            threading.Thread(target=self._serve, args=(conn, number), daemon=True).start()

    def _serve(self, conn: socket.socket, number: int) -> None:
        try:
            self._conversation(conn, number)
        except (OSError, StopIteration, ValueError):  # peer went away mid-conversation
            pass
        finally:
            conn.close()

    def _frames(self, conn: socket.socket) -> Iterator[dict[str, Any]]:
        decoder = FrameDecoder()
        while True:
            data = conn.recv(65536)
            if not data:
                return
            for body in decoder.feed(data):
                yield messages.validate_client_message(unpack_message(body))

    def _conversation(self, conn: socket.socket, number: int) -> None:
        if self.mode == "hangup":
            return
        if self.mode == "silent":
            while conn.recv(65536):
                pass
            return
        nonce = new_nonce()
        conn.sendall(encode_frame(messages.challenge(nonce)))
        frames = self._frames(conn)
        hello = next(frames)
        with self._cond:
            self.hellos.append(hello)
            self._cond.notify_all()
        sender = hello["sender"]
        squat = self.mode == "squat"  # a squatter takes every hello: it cannot check the MAC
        if not squat and not verify_hello_mac(self.token, nonce, hello["role"], sender, hello["mac"]):
            conn.sendall(encode_frame(messages.refuse("bad token")))
            return
        if self.mode == "refuse":
            conn.sendall(encode_frame(messages.refuse(self.refuse_reason)))
            return
        last_seq = self.held.get(sender, 0)
        proof = None
        if squat:
            proof = self.squat_proof  # the squatter cannot compute one
        elif self.token and "cnonce" in hello:
            proof = accept_proof(self.token, hello["cnonce"], nonce, hello["role"], sender, last_seq)
        conn.sendall(encode_frame(messages.accept(last_seq, proof)))
        received = 0
        for message in frames:
            if message["t"] == messages.BYE:
                with self._cond:
                    self.byes += 1
                    self._cond.notify_all()
                return
            received += 1
            with self._cond:
                self.batches.append((number, message["seq"], message["body"]))
                self._cond.notify_all()
            if self.drop_after is not None and received >= self.drop_after:
                return  # hang up without acking what this connection got
            if self.ack:  # the relay holds (and so acks) a batch, or neither
                with self._cond:
                    self.held[sender] = max(self.held.get(sender, 0), message["seq"])
                conn.sendall(encode_frame(messages.ack(message["seq"])))

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 15.0) -> bool:
        """Block until ``predicate()`` holds (generous bound: a shared 2-core box)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    def seqs(self, connection: int | None = None) -> list[int]:
        with self._cond:
            return [s for n, s, _ in self.batches if connection is None or n == connection]

    def close(self) -> None:
        self._closed = True
        try:  # wakes the thread blocked in accept(); close() alone would not on Linux
            self._server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._server.close()
        for conn in self._conns:
            try:
                conn.close()
            except OSError:
                pass
