"""``/metrics``: the OpenMetrics renderer, its HTTP shell, and a real scrape of
``serve --metrics-port`` during a real 2-rank torchrun job. Every exposition is
parsed with prometheus_client's OpenMetrics parser (a test-only dependency)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from tests.support.procs import EXAMPLES, DaemonProcess, base_env, free_port, torchrun, wait_for, wait_for_steps
from traceml_daemon.metrics.exposition import (
    CONTENT_TYPE,
    GpuMetrics,
    MetricsSnapshot,
    NodeMetrics,
    RankMetrics,
    VerdictMetric,
    render_openmetrics,
    start_metrics_server,
)

TRICKY = 'run "a"\\b\nc'  # quote, backslash and newline: all three must be escaped


def parse(text: str) -> dict[str, Any]:
    return {family.name: family for family in text_string_to_metric_families(text)}


def samples(families: dict[str, Any], name: str) -> list[Any]:
    return list(families[name].samples) if name in families else []


def snapshot() -> MetricsSnapshot:
    return MetricsSnapshot(
        ranks=[
            RankMetrics(TRICKY, "0", "0", 40, 20.0, {"dataloader": 1.5, "h2d": None, "wait": 3.0}),
            RankMetrics(TRICKY, "0", "1", 38, None, {}),
        ],
        nodes=[
            NodeMetrics(
                TRICKY, "0", "host-a", 55.5, 8 << 30, 64 << 30,
                [GpuMetrics("0", 97.0, 10 << 30, 80 << 30, 61.0, 300.5), GpuMetrics("1", None, None, None, None, None)],
            )
        ],
        verdicts=[
            VerdictMetric(TRICKY, "INPUT_STRAGGLER", "critical", node="0", rank="1"),
            VerdictMetric(TRICKY, "INPUT_STRAGGLER", "critical", node="0", rank="1"),  # repeated: one series
            VerdictMetric(TRICKY, "WAIT_HEAVY", "warn"),
        ],
        delivery={"frames_received": 12, "rows_stored": 900, "duplicates_discarded": 2, "rows_dropped_reported": 5},
        relay={"dropped_batches": 3, "spooled_batches": 7},
        process={"checkpoints": 4, "checkpoint_frames": 65_536},
    )


def test_renderer_output_parses_with_escaped_labels_units_and_no_fake_zeros() -> None:
    text = render_openmetrics(snapshot())
    assert text.endswith("# EOF\n")
    fams = parse(text)  # raises on any syntax error, duplicate series or bad metadata

    step = {s.labels["rank"]: s for s in samples(fams, "traceml_step_time_seconds")}
    assert fams["traceml_step_time_seconds"].type == "gauge"
    assert fams["traceml_step_time_seconds"].unit == "seconds"
    assert set(step) == {"0"}  # rank 1 has no median yet: absent, not 0
    assert step["0"].labels == {"session": TRICKY, "node": "0", "rank": "0"}
    assert step["0"].value == pytest.approx(0.020)

    phases = {s.labels["phase"]: s.value for s in samples(fams, "traceml_phase_time_seconds")}
    assert phases == {"dataloader": pytest.approx(0.0015), "wait": pytest.approx(0.003)}

    assert fams["traceml_steps"].type == "counter"
    steps = {s.labels["rank"]: (s.name, s.value) for s in samples(fams, "traceml_steps")}
    assert steps == {"0": ("traceml_steps_total", 40), "1": ("traceml_steps_total", 38)}

    gpu_util = samples(fams, "traceml_gpu_utilization_percent")
    assert [(s.labels["gpu"], s.value) for s in gpu_util] == [("0", 97.0)]
    assert samples(fams, "traceml_gpu_power_watts")[0].value == 300.5
    assert samples(fams, "traceml_node_memory_used_bytes")[0].value == 8 << 30
    assert samples(fams, "traceml_node_info")[0].labels["hostname"] == "host-a"

    verdicts = [s.labels for s in samples(fams, "traceml_verdict")]
    assert verdicts == [
        {"session": TRICKY, "name": "INPUT_STRAGGLER", "severity": "critical", "node": "0", "rank": "1"},
        {"session": TRICKY, "name": "WAIT_HEAVY", "severity": "warn"},
    ]

    assert samples(fams, "traceml_frames_received")[0].name == "traceml_frames_received_total"
    assert samples(fams, "traceml_frames_received")[0].value == 12
    assert samples(fams, "traceml_rows_dropped_reported")[0].value == 5
    relay = {s.labels["counter"]: s.value for s in samples(fams, "traceml_relay_delivery")}
    assert relay == {"dropped_batches": 3, "spooled_batches": 7}
    process = {s.labels["counter"]: (s.name, s.value) for s in samples(fams, "traceml_daemon_process")}
    assert process == {"checkpoints": ("traceml_daemon_process_total", 4),
                       "checkpoint_frames": ("traceml_daemon_process_total", 65_536)}


def test_empty_snapshot_is_a_valid_exposition() -> None:
    text = render_openmetrics(MetricsSnapshot())
    assert text == "# EOF\n"
    assert parse(text) == {}


async def _request(port: int, raw: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    data = await reader.read()  # the server closes after one response
    writer.close()
    return data


def test_http_shell_serves_get_and_head_and_refuses_the_rest() -> None:
    async def scenario() -> dict[str, bytes]:
        async def render() -> str:
            return render_openmetrics(snapshot())

        server = await start_metrics_server("127.0.0.1", 0, render)
        port = server.sockets[0].getsockname()[1]
        try:
            return {
                "get": await _request(port, b"GET /metrics?x=1 HTTP/1.1\r\nHost: x\r\n\r\n"),
                "head": await _request(port, b"HEAD /metrics HTTP/1.1\r\n\r\n"),
                "post": await _request(port, b"POST /metrics HTTP/1.1\r\n\r\n"),
                "other": await _request(port, b"GET / HTTP/1.1\r\n\r\n"),
                "junk": await _request(port, b"hello\r\n\r\n"),
            }
        finally:
            server.close()

    got = asyncio.run(scenario())
    head, _, body = got["get"].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert f"Content-Type: {CONTENT_TYPE}".encode() in head
    assert f"Content-Length: {len(body)}".encode() in head
    assert "traceml_step_time_seconds" in parse(body.decode())
    assert got["head"].startswith(b"HTTP/1.1 200 ") and got["head"].endswith(b"\r\n\r\n")
    assert got["post"].startswith(b"HTTP/1.1 405 ")
    assert got["other"].startswith(b"HTTP/1.1 404 ")
    assert got["junk"].startswith(b"HTTP/1.1 400 ")


def test_metrics_and_launch_modules_import_neither_torch_nor_prometheus_client() -> None:
    code = (
        "import sys\n"
        "import traceml_daemon.metrics.exposition, traceml_daemon.metrics.collect, traceml_daemon.commands.launch\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'prometheus_client'))\n"
        "assert not bad, bad\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=base_env(), timeout=60)
    assert done.returncode == 0, done.stderr


def _scrape(port: int) -> tuple[str, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.headers["Content-Type"], resp.read().decode("utf-8")


def test_scrape_real_daemon_during_real_torchrun_job(tmp_path: Path) -> None:
    db = tmp_path / "run.db"
    metrics_port = free_port()
    with DaemonProcess(db, args=["--metrics-port", str(metrics_port)]) as daemon:
        assert f"metrics on http://127.0.0.1:{metrics_port}/metrics" in daemon.log()
        content_type, text = _scrape(metrics_port)  # before any rank: counters only, still valid
        assert content_type == CONTENT_TYPE
        assert "traceml_frames_received" in parse(text)

        env = base_env(TRACEML_DAEMON=daemon.address, TRACEML_RELAY_PORT=str(free_port()))
        # A slow rank stretches the job so the scrape below usually lands mid-run; the
        # assertions hold either way, since the daemon keeps the windows after the job.
        job = torchrun(EXAMPLES / "train.py", ["--steps", "300", "--slow-ranks", "1", "--slow-ms", "10"],
                       nproc=2, env=env, background=True)
        try:

            def both_ranks() -> dict[str, Any] | None:
                try:
                    fams = parse(_scrape(metrics_port)[1])
                except (urllib.error.URLError, OSError):
                    return None
                ranks = {s.labels["rank"] for s in samples(fams, "traceml_step_time_seconds")}
                host = samples(fams, "traceml_node_cpu_percent")
                return fams if ranks >= {"0", "1"} and host else None

            fams = wait_for(both_ranks, timeout=240, interval=0.5, what="both ranks and the host in /metrics")
        finally:
            out, _ = job.communicate(timeout=300)
        assert job.returncode == 0, out
        summary = wait_for_steps(db, ranks=2, steps=300)

    session = summary["session"]
    step = {s.labels["rank"]: s for s in samples(fams, "traceml_step_time_seconds")}
    for rank in ("0", "1"):
        assert step[rank].labels == {"session": session, "node": "0", "rank": rank}
        assert step[rank].value > 0
    counted = {s.labels["rank"]: s.value for s in samples(fams, "traceml_steps")}
    assert set(counted) == {"0", "1"} and all(v > 0 for v in counted.values())
    phases = {(s.labels["rank"], s.labels["phase"]) for s in samples(fams, "traceml_phase_time_seconds")}
    assert {("0", "forward"), ("1", "backward"), ("1", "dataloader")} <= phases
    # examples/train.py's local rank 0 samples the host: one node, labelled like the ranks.
    cpu = samples(fams, "traceml_node_cpu_percent")
    assert [s.labels for s in cpu] == [{"session": session, "node": "0"}]
    assert samples(fams, "traceml_rows_stored")[0].value > 0
    assert samples(fams, "traceml_frames_received")[0].value > 0
    # The WAL checkpointer's counters, whether or not a checkpoint was due in so short a job.
    checkpointer = {s.labels["counter"] for s in samples(fams, "traceml_daemon_process")}
    assert checkpointer == {"checkpoints", "checkpoint_frames", "checkpoint_errors"}
