"""Prometheus / OpenMetrics exposition: a pure renderer and a tiny HTTP shell.

``render_openmetrics(snapshot)`` turns a ``MetricsSnapshot`` (plain data, built
by ``metrics_collect``) into OpenMetrics 1.0 text. ``start_metrics_server``
answers ``GET /metrics`` from the daemon's own event loop: one request per
connection, no framework, because a scrape every few seconds does not justify
a dependency (prometheus_client is only used by the tests, to parse us).

Units follow Prometheus conventions: times in seconds, sizes in bytes.
Counters are named by family (``traceml_steps``) and exposed as ``_total``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

log = logging.getLogger("traceml_daemon.metrics.exposition")

CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"
PREFIX = "traceml_"
MAX_REQUEST_HEAD = 16 * 1024  # a scrape request is a few hundred bytes; refuse anything bigger
REQUEST_TIMEOUT_S = 10.0  # a silent client must not hold a connection open forever

Labels = dict[str, str]


@dataclass
class RankMetrics:
    session: str
    node: str
    rank: str
    steps_seen: int
    step_ms_median: float | None
    phases_ms_median: dict[str, float | None] = field(default_factory=dict)


@dataclass
class GpuMetrics:
    gpu: str
    util_pct: float | None = None
    mem_used_bytes: int | None = None
    mem_total_bytes: int | None = None
    temp_c: float | None = None
    power_w: float | None = None


@dataclass
class NodeMetrics:
    session: str
    node: str
    hostname: str | None = None
    cpu_pct: float | None = None
    mem_used_bytes: int | None = None
    mem_total_bytes: int | None = None
    gpus: list[GpuMetrics] = field(default_factory=list)


@dataclass(frozen=True)
class VerdictMetric:
    session: str
    name: str
    severity: str
    node: str | None = None
    rank: str | None = None


@dataclass
class MetricsSnapshot:
    ranks: list[RankMetrics] = field(default_factory=list)
    nodes: list[NodeMetrics] = field(default_factory=list)
    verdicts: list[VerdictMetric] = field(default_factory=list)
    delivery: dict[str, int] = field(default_factory=dict)  # daemon counters: name -> cumulative value
    relay: dict[str, int] = field(default_factory=dict)  # relay stats summed over relays: name -> value
    # This daemon process's own counters since it started (its WAL checkpointer's): name -> value.
    process: dict[str, int] = field(default_factory=dict)
    # The database's files on disk and its pages in use: name -> bytes (metrics/collect.database_bytes).
    database: dict[str, int] = field(default_factory=dict)


# --------------------------------------------------------------------- render


def escape_label_value(value: str) -> str:
    """OpenMetrics label value escaping: backslash, double quote and newline."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _sanitize_name(name: str) -> str:
    # Relay stat names come from the wire; a metric name may only hold [a-zA-Z0-9_].
    out = "".join(c if c.isascii() and (c.isalnum() or c == "_") else "_" for c in name)
    return out if out and not out[0].isdigit() else "_" + out


def _format_value(value: float) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class _Family:
    """One metric family: metadata lines, then its samples (which must be contiguous)."""

    def __init__(self, name: str, kind: str, help_text: str, unit: str | None = None) -> None:
        self.name = PREFIX + name
        self.kind = kind
        self.help_text = help_text
        self.unit = unit
        self.samples: list[tuple[Labels, float]] = []
        self._seen: set[tuple[tuple[str, str], ...]] = set()

    def add(self, labels: Labels, value: float | None) -> None:
        if value is None:
            return  # "not measured" is an absent series, never a zero
        key = tuple(sorted(labels.items()))
        if key in self._seen:
            return  # a repeated label set would make the whole exposition invalid
        self._seen.add(key)
        self.samples.append((labels, value))

    def lines(self) -> Iterable[str]:
        if not self.samples:
            return
        yield f"# TYPE {self.name} {self.kind}"
        if self.unit:
            yield f"# UNIT {self.name} {self.unit}"
        yield f"# HELP {self.name} {self.help_text}"
        suffix = "_total" if self.kind == "counter" else ""
        for labels, value in self.samples:
            label_text = ",".join(f'{k}="{escape_label_value(v)}"' for k, v in labels.items())
            body = f"{{{label_text}}}" if label_text else ""
            yield f"{self.name}{suffix}{body} {_format_value(value)}"


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000.0


def _rank_families(ranks: list[RankMetrics]) -> list[_Family]:
    step = _Family("step_time_seconds", "gauge", "Median step time over the rank's recent window.", "seconds")
    phase = _Family("phase_time_seconds", "gauge", "Median phase time over the rank's recent window.", "seconds")
    steps = _Family("steps", "counter", "Steps stored for the rank since this daemon started.")
    for r in ranks:
        labels = {"session": r.session, "node": r.node, "rank": r.rank}
        step.add(labels, _seconds(r.step_ms_median))
        steps.add(labels, r.steps_seen)
        for name, ms in r.phases_ms_median.items():
            phase.add({**labels, "phase": name}, _seconds(ms))
    return [step, phase, steps]


def _node_families(nodes: list[NodeMetrics]) -> list[_Family]:
    info = _Family("node_info", "gauge", "Hostname of each node (value is always 1).")
    cpu = _Family("node_cpu_percent", "gauge", "Latest host CPU utilisation, percent.")
    mem = _Family("node_memory_used_bytes", "gauge", "Latest host memory in use.", "bytes")
    mem_total = _Family("node_memory_total_bytes", "gauge", "Host memory size.", "bytes")
    util = _Family("gpu_utilization_percent", "gauge", "Latest GPU utilisation, percent.")
    gmem = _Family("gpu_memory_used_bytes", "gauge", "Latest GPU memory in use.", "bytes")
    gmem_total = _Family("gpu_memory_total_bytes", "gauge", "GPU memory size.", "bytes")
    temp = _Family("gpu_temperature_celsius", "gauge", "Latest GPU temperature.", "celsius")
    power = _Family("gpu_power_watts", "gauge", "Latest GPU power draw.", "watts")
    for n in nodes:
        labels = {"session": n.session, "node": n.node}
        if n.hostname:
            info.add({**labels, "hostname": n.hostname}, 1)
        cpu.add(labels, n.cpu_pct)
        mem.add(labels, n.mem_used_bytes)
        mem_total.add(labels, n.mem_total_bytes)
        for g in n.gpus:
            gl = {**labels, "gpu": g.gpu}
            util.add(gl, g.util_pct)
            gmem.add(gl, g.mem_used_bytes)
            gmem_total.add(gl, g.mem_total_bytes)
            temp.add(gl, g.temp_c)
            power.add(gl, g.power_w)
    return [info, cpu, mem, mem_total, util, gmem, gmem_total, temp, power]


def _verdict_family(verdicts: list[VerdictMetric]) -> _Family:
    fam = _Family("verdict", "gauge", "Current diagnosis verdicts (value is always 1).")
    for v in verdicts:
        labels = {"session": v.session, "name": v.name, "severity": v.severity}
        if v.node is not None:
            labels["node"] = v.node
        if v.rank is not None:
            labels["rank"] = v.rank
        fam.add(labels, 1)
    return fam


def _delivery_families(snapshot: MetricsSnapshot) -> list[_Family]:
    out: list[_Family] = []
    for name, value in sorted(snapshot.delivery.items()):
        fam = _Family(_sanitize_name(name), "counter", f"Daemon delivery counter {name} (cumulative per database).")
        fam.add({}, value)
        out.append(fam)
    relay = _Family("relay_delivery", "counter", "Relay delivery counters, summed over the relays of the database.")
    for name, value in sorted(snapshot.relay.items()):
        relay.add({"counter": name}, value)
    out.append(relay)
    process = _Family("daemon_process", "counter", "Counters of this daemon process since it started.")
    for name, value in sorted(snapshot.process.items()):
        process.add({"counter": name}, value)
    out.append(process)
    return out


_DATABASE_HELP = {
    "database_size_bytes": "The database file and its WAL on disk.",
    "database_used_bytes": "Database pages in use: what retention's size cap (--max-db-mb) counts.",
}


def _database_families(database: dict[str, int]) -> list[_Family]:
    out: list[_Family] = []
    for name, value in sorted(database.items()):
        fam = _Family(_sanitize_name(name), "gauge", _DATABASE_HELP.get(name, name), "bytes")
        fam.add({}, value)
        out.append(fam)
    return out


def render_openmetrics(snapshot: MetricsSnapshot) -> str:
    """The whole exposition, ending with ``# EOF`` and a newline."""
    families = [
        *_rank_families(snapshot.ranks),
        *_node_families(snapshot.nodes),
        _verdict_family(snapshot.verdicts),
        *_delivery_families(snapshot),
        *_database_families(snapshot.database),
    ]
    lines = [line for fam in families for line in fam.lines()]
    lines.append("# EOF")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------- HTTP

Render = Callable[[], Awaitable[str]]


def _response(status: str, body: bytes, content_type: str, *, head_only: bool = False) -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode("ascii")
    return head if head_only else head + body


async def _answer(render: Render, request_head: bytes) -> bytes:
    request_line = request_head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = request_line.split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return _response("400 Bad Request", b"bad request\n", "text/plain; charset=utf-8")
    method, target = parts[0], parts[1].split("?", 1)[0]
    if target != "/metrics":
        return _response("404 Not Found", b"try /metrics\n", "text/plain; charset=utf-8")
    if method not in ("GET", "HEAD"):
        return _response("405 Method Not Allowed", b"GET only\n", "text/plain; charset=utf-8")
    try:
        body = (await render()).encode("utf-8")
    except Exception:
        # A rendering bug costs one scrape, never the daemon.
        log.exception("rendering /metrics failed")
        return _response("500 Internal Server Error", b"render failed\n", "text/plain; charset=utf-8")
    return _response("200 OK", body, CONTENT_TYPE, head_only=method == "HEAD")


async def _handle(render: Render, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            head = await reader.readuntil(b"\r\n\r\n")
            writer.write(await _answer(render, head))
            await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
        pass  # a client that went away or sent junk gets nothing more
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def start_metrics_server(host: str, port: int, render: Render) -> asyncio.Server:
    """Listen on ``host:port`` and answer ``GET /metrics`` with ``await render()``."""

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _handle(render, reader, writer)

    return await asyncio.start_server(on_connect, host, port, limit=MAX_REQUEST_HEAD)
