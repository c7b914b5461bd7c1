"""What the kernel says about a real server process (Linux /proc): its peak memory
and whether TCP keepalive is armed on one of its connections. Shared by the daemon
and relay tests, which run the real processes."""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path

from traceml_wire import auth, messages
from traceml_wire.framing import FrameDecoder, encode_frame, unpack_message

MIB = 1024 * 1024


def peak_rss(pid: int) -> int:
    """The process's peak resident set (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


def keepalive_armed(local_port: int, remote_port: int | None) -> bool:
    """True when the TCP socket from ``local_port`` to ``remote_port`` (IPv4; any remote
    port for None) runs its keepalive timer: /proc/net/tcp shows timer 2 on an idle
    socket only then."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, state, timer = int(fields[1].split(":")[1], 16), int(fields[2].split(":")[1], 16), fields[3], fields[5]
        if state == "01" and local == local_port and remote_port in (None, remote):
            return timer.startswith("02:")
    return False


def keepalive_armed_towards(remote_port: int) -> bool:
    """True when every established client socket connected to ``remote_port`` runs its
    keepalive timer (and there is one)."""
    found = False
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, state, timer = int(fields[1].split(":")[1], 16), int(fields[2].split(":")[1], 16), fields[3], fields[5]
        if state == "01" and remote == remote_port and local != remote_port:
            found = True
            if not timer.startswith("02:"):
                return False
    return found


class RawPeer:
    """A blocking socket speaking just enough of the wire to misbehave on purpose."""

    def __init__(self, port: int, source: str = "127.0.0.1", timeout: float = 60.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(source, 0))
        self.decoder = FrameDecoder()
        self.pending: list[bytes] = []

    @property
    def local_port(self) -> int:
        return int(self.sock.getsockname()[1])

    def recv(self) -> dict[str, object] | None:
        """The next message, or None once the server closed the connection."""
        while not self.pending:
            try:
                data = self.sock.recv(65536)
            except (ConnectionResetError, BrokenPipeError):
                return None
            if not data:
                return None
            self.pending.extend(self.decoder.feed(data))
        return unpack_message(self.pending.pop(0))

    def hello(self, sender: str, role: str = messages.ROLE_AGENT, token: str | None = None,
              session: str = "s1") -> dict[str, object] | None:
        """Answer the challenge with a good hello; the server's reply."""
        challenge = self.recv()
        assert challenge is not None and challenge["t"] == messages.CHALLENGE, challenge
        nonce = challenge["nonce"]
        assert isinstance(nonce, bytes)
        mac = auth.hello_mac(token, nonce, role, sender)
        self.sock.sendall(encode_frame(messages.hello(role=role, sender=sender, session=session, identity={},
                                                      mac=mac)))
        return self.recv()

    def stall_inside_a_frame(self, declared: int, sent: int) -> None:
        """A header declaring ``declared`` bytes and ``sent`` of them, then nothing. Sent from
        a thread's view: blocks while the server does not read (its budget is taken)."""
        try:
            self.sock.sendall(struct.pack(">I", declared) + b"\x00" * sent)
        except OSError:
            pass  # cut before all of it went out

    def closed_by_server(self) -> bool:
        """Block until the server closes this connection; True once it did."""
        deadline = time.monotonic() + (self.sock.gettimeout() or 60.0)
        while time.monotonic() < deadline:
            try:
                data = self.sock.recv(65536)
            except (ConnectionResetError, BrokenPipeError):
                return True
            except TimeoutError:
                return False
            if not data:
                return True
        return False

    def still_open(self) -> bool:
        """True while the server has not closed this connection (never blocks)."""
        timeout = self.sock.gettimeout()
        self.sock.setblocking(False)  # with a timeout set, recv would first wait for data
        try:
            data = self.sock.recv(65536, socket.MSG_PEEK)
        except BlockingIOError:
            return True
        except OSError:
            return False
        finally:
            self.sock.settimeout(timeout)
        return bool(data)

    def close(self) -> None:
        self.sock.close()
