"""Synthetic databases for the TUI's tests, benchmark and screenshots.

Writes rows with the real schema (``MIGRATIONS[0]``) and realistic shapes:
M nodes x N ranks, one straggler rank, host/GPU rows on each node's local
rank 0 with some values absent, scalars, a deep-dive layers table and an
FSDP2 model row. Deterministic: no randomness, fixed timestamps.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

from traceml_daemon.store.schema import MIGRATIONS, PRAGMAS
from traceml_wire.tables import columns

T0 = 1_700_000_000.0  # fixed epoch so snapshots never depend on the clock


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


def create_db(path: str) -> sqlite3.Connection:
    con = sqlite3.connect(path)
    for pragma in PRAGMAS:
        con.execute(pragma)
    for stmt in MIGRATIONS[0]:
        con.execute(stmt)
    con.commit()
    return con


def _insert(con: sqlite3.Connection, table: str, rows: list[tuple[object, ...]]) -> None:
    cols = ("rank_id",) + columns(table)
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
    )


def build(path: str, spec: SynthSpec = SynthSpec()) -> str:
    con = create_db(path)
    world = spec.nnodes * spec.ranks_per_node
    end = T0 + spec.steps * 0.05
    ranks = []
    for g in range(world):
        node, local = divmod(g, spec.ranks_per_node)
        ranks.append(
            (
                g + 1,
                f"s{g}",
                spec.session,
                0,
                g,
                local,
                node,
                world,
                spec.ranks_per_node,
                spec.nnodes,
                f"host{node}",
                1000 + g,
                "rdzv",
                spec.parallelism,
                "cpu",
                T0,
                end,
                1,
            )
        )
    con.executemany(
        "INSERT INTO ranks (rank_id, sender, session, attempt, global_rank, local_rank, node_rank, world_size, "
        "local_world_size, nnodes, hostname, pid, run_id, parallelism, device, first_seen, last_seen, last_seq) "
        "VALUES (" + ", ".join("?" * 18) + ")",
        ranks,
    )
    # Insert step by step across ranks, the way a live daemon interleaves them.
    rows = [step_row(g + 1, g, s, spec.straggler) for s in range(spec.steps) for g in range(world)]
    _insert(con, "steps", rows)
    _insert(
        con,
        "status",
        [(g + 1, end, "idle", end, spec.steps - 1, spec.steps, int(spec.finished)) for g in range(world)],
    )
    if spec.with_detail:
        _detail(con, spec, world)
    con.executemany(
        "INSERT INTO delivery (source, counter, value) VALUES (?, ?, ?)",
        [
            ("daemon", "frames_received", 400),
            ("daemon", "rows_stored", len(rows)),
            ("daemon", "duplicates_discarded", 2),
            ("relay:0", "rows_dropped", 0),
            ("relay:1", "spooled_batches", 3),
        ],
    )
    con.commit()
    con.close()
    return path


def _detail(con: sqlite3.Connection, spec: SynthSpec, world: int) -> None:
    n = min(spec.steps, 60)
    scalars = []
    for g in range(world):
        for s in range(spec.steps):
            scalars.append((g + 1, s, "loss", 2.0 / (1 + s * 0.05)))
            if s % 10 == 0:
                scalars.append((g + 1, s, "lr", 1e-3))
    _insert(con, "scalars", scalars)
    _insert(
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
            sys_rows.append((rid, T0 + i, 40.0 + node * 10, 64 * 2**30, 256 * 2**30, net, net, None, None))
            for gi in range(spec.ranks_per_node):
                power = None if gi == 1 else 250.0
                gpu_rows.append((rid, T0 + i, gi, 90.0 - gi, 40 * 2**30, 80 * 2**30, 60.0 + gi, power))
    _insert(con, "system", sys_rows)
    _insert(con, "gpu", gpu_rows)
    _insert(
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
    _insert(
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
