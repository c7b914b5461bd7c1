"""Command-line behaviour that needs no running peers."""

from __future__ import annotations

import signal
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

from tests.support.procs import DaemonProcess, base_env
from tests.traceml_daemon.wire_client import WireClient, agent_sender, peers_for, steps_body
from traceml_wire import messages


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "traceml_daemon", *args], capture_output=True, text=True, env=base_env(**env), timeout=60
    )


def test_non_loopback_bind_without_token_is_refused_at_start(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    done = run_cli("serve", "--host", "0.0.0.0", "--port", "0", "--db", str(db))
    assert done.returncode == 2
    assert "TRACEML_TOKEN" in done.stderr and "--token-file" in done.stderr
    assert "listening" not in done.stdout
    assert not db.exists()


def test_token_file_allows_non_loopback_and_never_leaks(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("file-token-123\n")
    daemon = DaemonProcess(tmp_path / "run.db", host="0.0.0.0", args=["--token-file", str(token_file)])
    with daemon:
        assert daemon.stop(signal.SIGINT) == 0
    assert "file-token-123" not in daemon.log()


def test_empty_token_file_is_a_usage_error(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("")
    done = run_cli("serve", "--port", "0", "--db", str(tmp_path / "x.db"), "--token-file", str(token_file))
    assert done.returncode == 2 and "empty" in done.stderr


def test_serve_refuses_a_database_newer_than_the_code(tmp_path: Path) -> None:
    db = tmp_path / "new.db"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")
    conn.execute("INSERT INTO meta VALUES ('schema_version', '999')")
    conn.commit()
    conn.close()
    done = run_cli("serve", "--port", "0", "--db", str(db))
    assert done.returncode == 2
    assert "newer" in done.stderr and "upgrade" in done.stderr


def test_help_lists_every_subcommand() -> None:
    done = run_cli("--help")
    assert done.returncode == 0
    for name in ("serve", "summary", "ingest", "tui", "compare", "export", "demo"):
        assert name in done.stdout


def test_byte_and_count_limits_must_be_positive(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    for flag, value, says in (
        ("--queue-bytes", "0", "--queue-bytes: 0 must be at least 1"),
        ("--inbound-bytes", "-5", "--inbound-bytes: -5 must be at least 1"),
        ("--max-connections", "many", "--max-connections: 'many' is not a whole number"),
        ("--hello-timeout", "0", "--hello-timeout: 0 must be above 0"),
    ):
        done = run_cli("serve", "--port", "0", "--db", str(db), flag, value)
        assert done.returncode == 2, flag
        assert says in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not db.exists()


def test_a_port_taken_between_bind_and_listen_is_a_clear_error(tmp_path: Path) -> None:
    """The daemon binds its port, then starts the metrics endpoint, then listens. Given
    the same port for both, the endpoint takes it in between (both sockets reuse the
    address), and uvloop's failed listen only closes the daemon's socket: that used to
    end in an AttributeError traceback (a test picking two free ports once got the same
    one twice). Now it is a one-line error naming the port, and exit status 1."""
    from tests.support.procs import free_port

    port = str(free_port())
    done = run_cli("serve", "--port", port, "--metrics-port", port, "--db", str(tmp_path / "run.db"))
    assert done.returncode == 1, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "another process" in done.stderr and "--port" in done.stderr
    assert "Traceback" not in done.stderr


def _modes(folder: Path) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir() if p.is_file()}


def test_database_and_summaries_are_private_unless_shared(tmp_path: Path) -> None:
    private, shared = tmp_path / "private", tmp_path / "shared"
    for folder, args in ((private, ()), (shared, ("--shared-files",))):
        folder.mkdir()
        old = folder / "run.db"
        old.write_bytes(b"")  # left world-readable by an earlier run
        old.chmod(0o644 if not args else 0o600)
        with DaemonProcess(old, args=args) as daemon:
            with WireClient(daemon.port) as c:
                assert c.handshake("relay/s1/n0/1-r")["t"] == messages.ACCEPT
                c.rbatch(1, [[agent_sender("s1", 0), 1, steps_body(0, 5)]], peers_for(0))
                assert c.recv() == {"t": "ack", "seq": 1}
            assert daemon.stop() == 0
    assert _modes(private) == {name: 0o600 for name in _modes(private)}
    assert {"run.db", "final_summary.json", "final_summary.txt"} <= set(_modes(private))
    assert all(mode & 0o044 for mode in _modes(shared).values()), _modes(shared)
