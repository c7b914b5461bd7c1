"""The opt-in memory report: what it reads, how it parses its switch, and the real
daemon logging it while it stores rows."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.procs import DaemonProcess, base_env, wait_for
from tests.traceml_daemon.wire_client import RELAY, WireClient, agent_sender, count_steps, peers_for, steps_body
from traceml_daemon.net import memdebug
from traceml_wire import messages


@pytest.mark.parametrize("raw", ["", "   "])
def test_unset_switch_means_no_report(raw: str) -> None:
    assert memdebug.interval_from_env({memdebug.ENV_INTERVAL: raw}) is None
    assert memdebug.interval_from_env({}) is None


@pytest.mark.parametrize("raw", ["abc", "0", "-3", "nan", "inf"])
def test_bad_switch_is_named_in_a_warning_and_turns_the_report_off(raw: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="traceml_daemon.net.memdebug"):
        assert memdebug.interval_from_env({memdebug.ENV_INTERVAL: raw}) is None
    assert memdebug.ENV_INTERVAL in caplog.text and repr(raw) in caplog.text


def test_switch_takes_fractional_seconds() -> None:
    assert memdebug.interval_from_env({memdebug.ENV_INTERVAL: " 0.5 "}) == 0.5


def test_rss_split_reads_this_process() -> None:
    anon, file = memdebug.rss_split()
    # A running CPython holds megabytes of heap and maps its own binary and libraries.
    assert anon > 1024 and file > 0
    info = memdebug.mallinfo()
    if info is not None:  # glibc >= 2.33
        assert info["in_use"] > 0 and set(info) == {"arena", "mmapped", "in_use", "free"}


def test_rss_split_reads_another_process_and_a_gone_one_reads_zero() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; b = b'x' * (64 << 20); sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        wait_for(lambda: memdebug.rss_split(child.pid)[0] > 60 * 1024, 30, what="the child's 64 MiB")
    finally:
        child.communicate(b"")
    assert memdebug.rss_split(child.pid) == (0, 0)


def test_report_logs_sizes_and_with_tracing_the_sites_that_grew(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(memdebug.ENV_TRACE, "1")
    hoard: list[bytes] = []

    def sizes() -> dict[str, int]:
        hoard.append(bytes(256 * 1024))  # grows between reports: must show up as a growth site
        return {"hoard": len(hoard)}

    async def two_reports() -> None:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.35):
                await memdebug.report_forever(0.1, sizes)

    try:
        with caplog.at_level(logging.WARNING, logger="traceml_daemon.net.memdebug"):
            asyncio.run(two_reports())
    finally:
        import tracemalloc

        tracemalloc.stop()
    reports = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memdebug: rss anon")]
    assert len(reports) >= 2
    assert "hoard 1" in reports[0] and "traced" in reports[0]
    growth = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memdebug growth:")]
    assert any("test_memdebug.py" in line for line in growth)


def test_daemon_reports_its_maps_while_storing(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    env = base_env(**{memdebug.ENV_INTERVAL: "0.2"})
    with DaemonProcess(db, env=env) as daemon:
        with WireClient(daemon.port) as c:
            assert c.handshake(RELAY)["t"] == messages.ACCEPT
            c.rbatch(1, [[agent_sender("s1", 0), 1, steps_body(0, 10)]], peers_for(0))
            assert c.recv() == {"t": "ack", "seq": 1}
            wait_for(lambda: "known 1 " in daemon.log(), 30, what="a memory report after the first commit")
        assert count_steps(db) == 10
        assert daemon.stop() == 0
    line = next(x for x in daemon.lines if "known 1 " in x)
    for field in ("rss anon", "sqlite used", "templates 1", "backlog_rows", "queue_bytes", "conns 1"):
        assert field in line, (field, line)


def test_daemon_without_the_switch_stays_quiet(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path / "run.db") as daemon:
        with WireClient(daemon.port) as c:
            assert c.handshake(RELAY)["t"] == messages.ACCEPT
            c.rbatch(1, [[agent_sender("s1", 0), 1, steps_body(0, 3)]], peers_for(0))
            assert c.recv() == {"t": "ack", "seq": 1}
        assert daemon.stop() == 0
    assert "memdebug" not in daemon.log()
