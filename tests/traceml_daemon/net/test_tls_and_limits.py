"""Exposure limits of the real daemon process: TLS, --max-connections and the
pre-hello frame cap, driven by real sockets speaking the real wire.

``make_certs`` is also used by ``tests/relay/test_relay_tls.py``.
"""

from __future__ import annotations

import socket
import ssl
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.procs import DaemonProcess, wait_for
from tests.traceml_daemon.wire_client import (
    RELAY,
    WireClient,
    agent_sender,
    count_steps,
    daemon_counters,
    peers_for,
    steps_body,
)
from traceml_wire import MAX_HELLO_FRAME_BYTES, auth, messages
from traceml_wire.framing import encode_frame


@dataclass(frozen=True)
class Certs:
    ca: Path  # the CA that signed ``cert``
    cert: Path  # server certificate for 127.0.0.1 (IP subjectAltName)
    key: Path
    other_ca: Path  # a CA that signed nothing here: verification with it must fail


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _new_ca(directory: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN=traceml test {name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=directory)


def make_certs(directory: Path) -> Certs:
    """A test CA, a server certificate it signed for 127.0.0.1, and an unrelated CA (openssl CLI)."""
    directory.mkdir(parents=True, exist_ok=True)
    _new_ca(directory, "ca")
    _new_ca(directory, "other-ca")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1", cwd=directory)
    (directory / "server.ext").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.pem", "-days", "2", "-extfile", "server.ext", cwd=directory)
    return Certs(ca=directory / "ca.pem", cert=directory / "server.pem", key=directory / "server.key",
                 other_ca=directory / "other-ca.pem")


needs_openssl = pytest.mark.skipif(
    subprocess.run(["which", "openssl"], capture_output=True).returncode != 0, reason="needs the openssl CLI"
)


def tls_client(port: int, ca: Path) -> WireClient:
    """A WireClient whose socket speaks TLS, verifying the daemon against ``ca``."""
    client = WireClient(port)
    context = ssl.create_default_context(cafile=str(ca))
    client.sock = context.wrap_socket(client.sock, server_hostname="127.0.0.1")
    return client





def tls_args(certs: Certs) -> list[str]:
    return ["--tls-cert", str(certs.cert), "--tls-key", str(certs.key)]


# ------------------------------------------------------------------ TLS


@needs_openssl
def test_tls_daemon_stores_from_tls_clients_and_refuses_plaintext_ones(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs")
    db = tmp_path / "run.db"
    with DaemonProcess(db, args=[*tls_args(certs), "--hello-timeout", "2"]) as daemon:
        # A plaintext peer: its bytes are no TLS record, so the handshake fails and it is closed.
        with WireClient(daemon.port) as plain:
            plain_port = plain.sock.getsockname()[1]
            plain.send(messages.hello(role=messages.ROLE_RELAY, sender=RELAY, session="s1", identity={},
                                      mac=auth.hello_mac(None, b"x" * 16, messages.ROLE_RELAY, RELAY)))
            assert plain.recv() is None
        wait_for(lambda: f"refused 127.0.0.1:{plain_port}: TLS handshake failed" in daemon.log(), 20,
                 what="TLS refusal logged")
        # A plaintext peer that waits for the challenge never gets one; the hello timeout ends it.
        with WireClient(daemon.port) as silent:
            silent_port = silent.sock.getsockname()[1]
            assert silent.recv() is None
        wait_for(lambda: f"refused 127.0.0.1:{silent_port}: TLS handshake failed" in daemon.log(), 20,
                 what="TLS handshake timeout logged")
        # The daemon keeps serving TLS clients: hello, batch, ack after commit.
        with tls_client(daemon.port, certs.ca) as client:
            assert client.handshake(RELAY)["t"] == messages.ACCEPT
            client.rbatch(1, [[agent_sender("s1", 0), 1, steps_body(0, 10)]], peers_for(0))
            assert client.recv() == {"t": "ack", "seq": 1}
            assert count_steps(db) == 10
        assert daemon.stop() == 0
    assert daemon_counters(db)["refused_peers"] == 2


@needs_openssl
def test_tls_client_against_a_plaintext_daemon_is_told_apart_in_the_log(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs")
    with DaemonProcess(tmp_path / "run.db") as daemon:
        raw = socket.create_connection(("127.0.0.1", daemon.port), timeout=20)
        context = ssl.create_default_context(cafile=str(certs.ca))
        with pytest.raises((ssl.SSLError, ConnectionError)):
            context.wrap_socket(raw, server_hostname="127.0.0.1")
        raw.close()
        wait_for(lambda: "a TLS client hello" in daemon.log(), 20, what="TLS client hint logged")
        with WireClient(daemon.port) as c:
            assert c.handshake(RELAY)["t"] == messages.ACCEPT
        assert daemon.stop() == 0


@needs_openssl
def test_unreadable_tls_files_fail_at_start_with_the_reason(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs")
    daemon = DaemonProcess(tmp_path / "run.db", args=["--tls-cert", str(certs.cert), "--tls-key",
                                                      str(tmp_path / "missing.key")])
    proc = subprocess.run(daemon.command(), env=daemon.env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "--tls-key" in proc.stderr and "missing.key" in proc.stderr and "Traceback" not in proc.stderr


# ---------------------------------------------------------- --max-connections


def test_connection_over_the_maximum_is_refused_and_the_others_keep_working(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    with DaemonProcess(db, args=["--max-connections", "2"]) as daemon:
        first, second = WireClient(daemon.port), WireClient(daemon.port)
        try:
            assert first.handshake(RELAY)["t"] == messages.ACCEPT
            assert second.handshake("relay/s1/n1/2-r")["t"] == messages.ACCEPT
            with WireClient(daemon.port) as third:
                third_port = third.sock.getsockname()[1]
                reply = third.recv()
                assert reply is not None and reply["t"] == messages.REFUSE
                assert "too many connections" in reply["reason"]
                assert third.recv() is None
            wait_for(lambda: f"refused 127.0.0.1:{third_port}: too many connections" in daemon.log(), 20,
                     what="refusal logged")
            # The two admitted peers are unaffected.
            first.rbatch(1, [[agent_sender("s1", 0), 1, steps_body(0, 10)]], peers_for(0))
            assert first.recv() == {"t": "ack", "seq": 1}
            second.rbatch(1, [[agent_sender("s1", 1), 1, steps_body(0, 7)]], peers_for(1))
            assert second.recv() == {"t": "ack", "seq": 1}
        finally:
            first.close()
        # A freed slot admits a new peer (the daemon notices the close asynchronously: retry until it has).
        def admitted() -> bool:
            with WireClient(daemon.port) as again:
                challenge = again.recv()
                if challenge is None or challenge["t"] != messages.CHALLENGE:
                    return False  # still full: refused before the challenge
                mac = auth.hello_mac(None, challenge["nonce"], messages.ROLE_RELAY, "relay/s1/n2/3-r")
                again.send(messages.hello(role=messages.ROLE_RELAY, sender="relay/s1/n2/3-r", session="s1",
                                          identity={}, mac=mac))
                reply = again.recv()
                return reply is not None and reply["t"] == messages.ACCEPT

        wait_for(admitted, 20, what="a slot freed by a closed peer")
        second.close()
        assert daemon.stop() == 0
    assert count_steps(db) == 17
    assert daemon_counters(db)["refused_peers"] >= 1


# ------------------------------------------------------------ pre-hello cap


def test_large_frame_before_the_hello_is_refused_and_the_full_cap_applies_after(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    a0 = agent_sender("s1", 0)
    with DaemonProcess(db) as daemon:  # default --max-frame-bytes: 16 MiB
        with WireClient(daemon.port) as bad:
            assert bad.recv()["t"] == messages.CHALLENGE
            bad.sock.sendall(struct.pack(">I", 1024 * 1024))  # only the header: refused before any body
            reply = bad.recv()
            assert reply is not None and reply["t"] == messages.REFUSE
            assert "pre-hello cap" in reply["reason"]
            assert bad.recv() is None
        # After the accept, frames far over the pre-hello cap are fine: the hello and a
        # ~200 KiB batch sent back to back in one write, so they reach the daemon together.
        big = steps_body(0, 4000)
        assert len(big) > 2 * MAX_HELLO_FRAME_BYTES
        with WireClient(daemon.port) as good:
            challenge = good.recv()
            assert challenge is not None
            mac = auth.hello_mac(None, challenge["nonce"], messages.ROLE_RELAY, RELAY)
            hello = messages.hello(role=messages.ROLE_RELAY, sender=RELAY, session="s1", identity={}, mac=mac)
            batch = messages.relay_batch(1, [[a0, 1, big]], peers_for(0), {"node_rank": 0, "hostname": "h0"}, {})
            good.sock.sendall(encode_frame(hello) + encode_frame(batch))
            assert good.recv()["t"] == messages.ACCEPT
            assert good.recv() == {"t": "ack", "seq": 1}
        assert daemon.stop() == 0
    assert "exceeds the pre-hello cap" in daemon.log()
    assert count_steps(db) == 4000
    assert daemon_counters(db)["oversize_frames"] == 1
