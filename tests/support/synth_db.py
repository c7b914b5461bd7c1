"""Synthetic databases for the tests, the TUI benchmark and screenshots.

Writes rows with realistic shapes: M nodes x N ranks, one straggler rank,
host/GPU rows on each node's local rank 0 with some values absent, scalars, a
deep-dive layers table, an FSDP2 model row, and delivery counters under the
names the daemon, relays (``relay.upstream.RelayStats``) and agents
(``agent.rank_runtime`` and its tracer) really report. Deterministic: no
randomness, fixed timestamps.

The schema is the current one, reached the way the daemon reaches it: the rows
go into a version 1 database, then ``store.migrate.migrate`` (what ``serve``
runs at start) applies every later step in order, backfilling the history
tables from the raw steps. ``build(..., version=1)`` stops before that, for
the readers' fallback on databases an old daemon left behind.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, fields

from relay.upstream import RelayStats
from traceml_daemon.ingest.counters import Counters
from traceml_daemon.store.migrate import migrate
from traceml_daemon.store.migrations import MIGRATIONS
from traceml_daemon.store.schema import PRAGMAS, RANK_COLUMNS, SCHEMA_VERSION
from traceml_wire.tables import columns

T0 = 1_700_000_000.0  # fixed epoch so snapshots never depend on the clock
GiB = 2**30

# Counter names as stored in ``delivery``, one list per kind of source, taken from
# where each side declares them.
DAEMON_COUNTERS = tuple(f.name for f in fields(Counters))
RELAY_COUNTERS = tuple(f.name for f in fields(RelayStats))
# A CPU run's agent counters (a CUDA run adds the tracer's events_exhausted);
# tests/traceml_daemon/tui/test_real_run.py checks all three lists against a real run.
AGENT_COUNTERS = (
    "recorder_rows", "sender_batches", "sender_bytes", "agent_errors", "tracer_errors",
    "device_steps_dropped", "device_steps_fallback", "device_steps_overflow", "steps_dropped", "scalars_dropped",
    "output_lines_rate_dropped", "output_lines_full_dropped", "output_lines_cut",  # output capture, on by default
    "spans_dropped", "session_events_dropped", "session_phases_orphaned", "session_phases_unended",
    "sessions_untracked",
)  # fmt: skip


@dataclass(frozen=True)
class SynthSpec:
    nnodes: int = 2
    ranks_per_node: int = 2
    steps: int = 200
    parallelism: str = "ddp"
    straggler: int | None = 3  # global rank that is 40% slower in forward
    finished: bool = True
    session: str = "run-synth"
    with_detail: bool = True  # scalars, layers, models, process/system/gpu
    saturated_node: int | None = None  # this node's host: CPU 99% busy, RAM 250 of 256 GiB used
    # Delivery losses: rank 0's recorder lost rows; node 0's relay lost batches
    # (spool_dropped_batches is already part of dropped_batches, as in RelayStats).
    rows_dropped: int = 0
    relay_dropped_batches: int = 0
    relay_dropped_bytes: int = 0
    spool_dropped_batches: int = 0


def create_db(path: str) -> sqlite3.Connection:
    """A version 1 database, as ``store.migrate`` leaves an empty file after its first step."""
    con = sqlite3.connect(path)
    for pragma in PRAGMAS:
        con.execute(pragma)
    for stmt in MIGRATIONS[0]:
        con.execute(stmt)
    con.execute("INSERT INTO meta (key, value) VALUES ('schema_version', '1'), ('created_at', ?)", (repr(T0),))
    con.commit()
    return con


def insert_rows(con: sqlite3.Connection, table: str, rows: list[tuple[object, ...]]) -> None:
    # Rows state the table's first columns; columns appended later (schema.LATER_COLUMNS,
    # absent from the v1 tables written here) stay NULL, as in a database of before them.
    width = len(rows[0]) - 1 if rows else len(columns(table))
    cols = ("rank_id",) + columns(table)[:width]
    marks = ", ".join("?" for _ in cols)
    con.executemany(f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({marks})", rows)


def step_row(rank_id: int, global_rank: int, step: int, straggler: int | None) -> tuple[object, ...]:
    ms = 1_000_000
    slow = global_rank == straggler
    dl = 2 * ms + (step % 5) * 100_000
    h2d = 1 * ms
    fwd = (14 if slow else 10) * ms
    bwd = 20 * ms
    opt = 5 * ms
    wait = 1 * ms if slow else 5 * ms
    total = dl + h2d + fwd + bwd + opt + wait
    ts = T0 + step * 0.05
    peak = 2_000_000_000 + step * 1_000
    return (
        rank_id,
        step,
        ts,
        total,
        dl,
        h2d,
        fwd,
        bwd,
        opt,
        wait,
        None,
        peak,
        peak + 500_000_000,
        3_000_000_000 + global_rank,
        0,
        None,  # the FSDP2 collective wait and memory after forward: not measured
        None,
        None,
        None,
    )


def _sender(spec: SynthSpec, g: int) -> str:
    node = g // spec.ranks_per_node
    return f"{spec.session}/a0/n{node}/r{g}/{1000 + g}-synth"  # an agent's sender id (docs/internals.md)


def build(path: str, spec: SynthSpec = SynthSpec(), version: int = SCHEMA_VERSION) -> str:
    """Write the run of ``spec`` to ``path`` at schema ``version`` (1, or the current one)."""
    if version not in (1, SCHEMA_VERSION):
        raise ValueError(f"synth builds schema 1 or {SCHEMA_VERSION}, not {version}")
    con = create_db(path)
    world = spec.nnodes * spec.ranks_per_node
    end = T0 + spec.steps * 0.05
    ranks = []
    for g in range(world):
        node, local = divmod(g, spec.ranks_per_node)
        row = {
            "rank_id": g + 1, "sender": _sender(spec, g), "session": spec.session, "attempt": 0,
            "global_rank": g, "local_rank": local, "node_rank": node, "world_size": world,
            "local_world_size": spec.ranks_per_node, "nnodes": spec.nnodes, "hostname": f"host{node}",
            "pid": 1000 + g, "parallelism": spec.parallelism, "device": "cpu",
            "first_seen": T0, "last_seen": end, "last_seq": 1,
        }  # fmt: skip
        ranks.append(tuple(row[col] for col in RANK_COLUMNS))  # a KeyError names a newly declared field
    # Every declared identity column exists in v1 too (v6 only dropped run_id).
    con.executemany(
        f"INSERT INTO ranks ({', '.join(RANK_COLUMNS)}) VALUES ({', '.join('?' * len(RANK_COLUMNS))})", ranks
    )
    # Insert step by step across ranks, the way a live daemon interleaves them.
    rows = [step_row(g + 1, g, s, spec.straggler) for s in range(spec.steps) for g in range(world)]
    insert_rows(con, "steps", rows)
    insert_rows(
        con,
        "status",
        [(g + 1, end, "idle", end, spec.steps - 1, spec.steps, int(spec.finished)) for g in range(world)],
    )
    if spec.with_detail:
        _detail(con, spec, world)
    con.executemany("INSERT INTO delivery (source, counter, value) VALUES (?, ?, ?)", _delivery(spec, len(rows)))
    con.commit()
    con.close()
    if version == SCHEMA_VERSION:
        migrate(path)
    return path


def _delivery(spec: SynthSpec, rows_stored: int) -> list[tuple[str, str, int]]:
    """Every source's cumulative counters, as the daemon stores them (``counters.py`` prefixes)."""
    daemon = dict.fromkeys(DAEMON_COUNTERS, 0)
    daemon.update(frames_received=400, rows_stored=rows_stored, duplicates_discarded=2, connections=spec.nnodes)
    out = [("daemon", k, v) for k, v in daemon.items()]
    for node in range(spec.nnodes):
        relay = dict.fromkeys(RELAY_COUNTERS, 0)
        relay.update(agents_connected=spec.ranks_per_node, received_batches=100, rbatches_sent=50, rbatches_acked=50)
        if node == 0:
            relay.update(
                dropped_batches=spec.relay_dropped_batches + spec.spool_dropped_batches,
                dropped_bytes=spec.relay_dropped_bytes,
                spool_dropped_batches=spec.spool_dropped_batches,
                spooled_batches=spec.spool_dropped_batches,  # dropped from the spool: spooled first
            )
        if node == 1:
            relay["spooled_batches"] = 3  # delayed by a blip, resent: not a loss
        out += [(f"relay:relay/{spec.session}/n{node}/{2000 + node}-synth", k, v) for k, v in relay.items()]
    for g in range(spec.nnodes * spec.ranks_per_node):
        agent = dict.fromkeys(AGENT_COUNTERS, 0)
        if g == 0:
            agent["recorder_rows"] = spec.rows_dropped
        out += [(f"agent:{_sender(spec, g)}", k, v) for k, v in agent.items()]
    return out


def _detail(con: sqlite3.Connection, spec: SynthSpec, world: int) -> None:
    n = min(spec.steps, 60)
    scalars = []
    for g in range(world):
        for s in range(spec.steps):
            scalars.append((g + 1, s, "loss", 2.0 / (1 + s * 0.05)))
            if s % 10 == 0:
                scalars.append((g + 1, s, "lr", 1e-3))
    insert_rows(con, "scalars", scalars)
    insert_rows(
        con,
        "process",
        [(g + 1, T0 + i, 50.0 + g, 3_000_000_000 + g, None, 12) for g in range(world) for i in range(n)],
    )
    sys_rows = []
    gpu_rows = []
    for node in range(spec.nnodes):
        rid = node * spec.ranks_per_node + 1  # local rank 0 samples the host
        for i in range(n):
            # Node 1 lacks network counters: absent stays absent.
            net = None if node == 1 else 1e6
            cpu, used = (99.0, 250 * GiB) if node == spec.saturated_node else (40.0 + node * 10, 64 * GiB)
            sys_rows.append((rid, T0 + i, cpu, used, 256 * GiB, net, net, None, None))
            for gi in range(spec.ranks_per_node):
                power = None if gi == 1 else 250.0
                gpu_rows.append((rid, T0 + i, gi, 90.0 - gi, 40 * 2**30, 80 * 2**30, 60.0 + gi, power))
    insert_rows(con, "system", sys_rows)
    insert_rows(con, "gpu", gpu_rows)
    insert_rows(
        con,
        "layers",
        [
            (1, s, name, fwd, fwd * 2, act)
            for s in (50, 100)
            for name, fwd, act in (
                ("embed", 400_000, 8 * 2**20),
                ("blocks.0", 2_100_000, 64 * 2**20),
                ("blocks.1", 2_000_000, 64 * 2**20),
                ("head", 700_000, 16 * 2**20),
            )
        ],
    )
    shard = 7 * 2**30 // world
    insert_rows(
        con,
        "models",
        [
            (
                g + 1,
                0,
                "Transformer",
                spec.parallelism,
                42,
                7 * 2**30,
                shard if spec.parallelism == "fsdp2" else None,
                7 * 2**30 if spec.parallelism == "fsdp2" else None,
            )
            for g in range(world)
        ],
    )
