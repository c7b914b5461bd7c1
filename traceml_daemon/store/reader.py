"""Rank identity and the analysis engine's input, read through the read layer (``store.read``).

The summary, compare, the TUI's analyzer and ``/metrics`` load data through here:

    conn = open_readonly(path)             # raises StoreError naming the path
    run = resolve_run(conn, session)       # RunRef(session, attempt): that session's or the latest;
                                           # None when empty, UnknownSession when not there
    ranks = load_ranks(conn, run)          # list[RankRow]
    data = load_run(conn, run, last_n=200) # analysis.model.RunData
    counters = delivery_counters(conn)     # flat summary counters

``RankRow`` is the one reading of the ``ranks`` table: every reader that needs a
rank's identity (the TUI, export, ``/metrics``) gets it from ``load_ranks`` or
``all_ranks``. The names re-exported from ``store.read`` are the ones this
module always offered.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from typing import Any

from traceml_daemon.analysis.model import PHASES, NodeSystem, NonFinite, RankData, RunData
from traceml_daemon.store.read import detail, fingerprints, fsdp2, samples, steps
from traceml_daemon.store.read.connect import StoreError, open_readonly, schema_version
from traceml_daemon.store.read.delivery import AGENT_BATCH_DROPS, AGENT_ROW_DROPS, RELAY_BATCH_DROPS, delivery_counters
from traceml_daemon.store.read.detail import fsdp2_memory
from traceml_daemon.store.read.runs import (
    RunRef,
    UnknownSession,
    current_run,
    latest_run,
    list_runs,
    resolve_run,
    run_bounds,
    run_parallelism,
)
from traceml_daemon.store.read.steps import StepCounts
from traceml_daemon.store.schema import RANK_COLUMNS

__all__ = [
    "AGENT_BATCH_DROPS", "AGENT_ROW_DROPS", "RELAY_BATCH_DROPS", "SAMPLE_BUDGET_ROWS", "SAMPLE_MIN_STEPS",
    "SAMPLE_TAIL_STEPS", "RankRow", "RunRef", "StepCounts", "StoreError", "UnknownSession", "all_ranks",
    "current_run", "delivery_counters", "fsdp2_memory", "latest_run", "list_runs", "load_rank_data", "load_ranks",
    "load_run", "load_systems", "load_window_run", "open_readonly", "resolve_run", "run_bounds", "run_parallelism",
    "schema_version",
]

# Older names of the step counts, still called by the summary's tests.
_step_counts_many = steps.step_counts
_step_counts = steps.rank_step_counts


@dataclass
class RankRow:
    """One row of ``ranks``: a rank process as the daemon saw it. Fields in
    ``schema.RANK_COLUMNS`` order (identity fields: traceml_wire/identity.py)."""

    rank_id: int
    sender: str
    session: str
    attempt: int
    global_rank: int | None
    local_rank: int | None
    node_rank: int | None
    world_size: int | None
    local_world_size: int | None
    nnodes: int | None
    hostname: str | None
    pid: int | None
    parallelism: str | None
    device: str | None
    first_seen: float | None
    last_seen: float | None
    last_seq: int


_RANK_SELECT = f"SELECT {', '.join(RANK_COLUMNS)} FROM ranks"

def load_ranks(conn: sqlite3.Connection, run: RunRef, after: int = 0) -> list[RankRow]:
    """The ranks of ``run`` by global rank; ``after``: only those with a higher rank id
    (senders a live view has not seen yet)."""
    rows = conn.execute(
        _RANK_SELECT + " WHERE session=? AND attempt=? AND rank_id>? ORDER BY global_rank, rank_id",
        (run.session, run.attempt, after),
    ).fetchall()
    return [RankRow(*row) for row in rows]


def all_ranks(conn: sqlite3.Connection, session: str | None = None) -> list[RankRow]:
    """Every rank in the database, or of one ``session``, in rank id order."""
    if session is None:
        rows = conn.execute(_RANK_SELECT + " ORDER BY rank_id").fetchall()
    else:
        rows = conn.execute(_RANK_SELECT + " WHERE session=? ORDER BY rank_id", (session,)).fetchall()
    return [RankRow(*row) for row in rows]


# ---------------------------------------------------------------- the analysis engine's input


def load_rank_data(
    conn: sqlite3.Connection,
    rank: RankRow,
    last_n: int | None = None,
    cap: int | None = None,
    counts: StepCounts | None = None,
) -> RankData:
    """One rank's steps: all, the newest ``last_n``, or (``cap``) a bounded sample of a long run
    (``counts``: the rank's, when already read with others by ``steps.step_counts``)."""
    data = RankData(
        global_rank=rank.global_rank if rank.global_rank is not None else -rank.rank_id,
        local_rank=rank.local_rank,
        node_rank=rank.node_rank,
        hostname=rank.hostname,
    )
    if cap is not None:
        counts = counts or steps.rank_step_counts(conn, rank.rank_id)
        data.steps_stored = counts.total
        rows = steps.sampled_steps(conn, rank.rank_id, counts, cap, SAMPLE_TAIL_STEPS)
    else:
        rows = steps.rank_steps(conn, rank.rank_id, last_n)
    _fill_steps(data, rows)
    data.status = steps.rank_status(conn, rank.rank_id)
    return data


def _fill_steps(data: RankData, rows: list[tuple[Any, ...]]) -> None:
    """``data``'s step columns from ``steps.STEP_COLS`` rows, oldest first."""
    if not rows:
        data.phases_ns = {p: [] for p in PHASES}
        return
    by = dict(zip(steps.STEP_COLS, zip(*rows, strict=True), strict=True))
    data.steps = list(by["step"])
    data.step_ts = list(by["ts"])
    data.step_ns = list(by["step_ns"])
    data.phases_ns = {p: list(by[f"{p}_ns"]) for p in PHASES}
    data.comm_ns = list(by["comm_ns"])
    data.peak_bytes = list(by["peak_bytes"])
    data.reserved_bytes = list(by["reserved_bytes"])
    data.rss_bytes = list(by["rss_bytes"])


def load_systems(
    conn: sqlite3.Connection, run: RunRef, last_n: int = 120, ranks: list[RankRow] | None = None
) -> list[NodeSystem]:
    """Latest host and GPU samples per node (reported by each node's local rank 0);
    ``ranks``: the run's, when already read."""
    out: dict[int, NodeSystem] = {}
    for rank in ranks if ranks is not None else load_ranks(conn, run):
        if rank.node_rank is None:
            continue
        node = out.setdefault(rank.node_rank, NodeSystem(node_rank=rank.node_rank, hostname=rank.hostname))
        rows = samples.host_samples(conn, rank.rank_id, last_n)
        if rows:
            node.cpu_pct = [r[1] for r in rows]
            node.mem_used_bytes = [r[2] for r in rows]
            node.mem_total_bytes = rows[-1][3]
        for idx, util, temp, used, total in samples.gpu_samples(conn, rank.rank_id, last_n * 8):
            if idx is None:
                continue
            node.gpu_util_pct.setdefault(idx, []).append(util)
            node.gpu_temp_c.setdefault(idx, []).append(temp)
            node.gpu_mem_used_bytes.setdefault(idx, []).append(used)
            node.gpu_mem_total_bytes[idx] = total
    return [out[k] for k in sorted(out)]


# A whole-run read (the final summary) loads at most about this many step rows, so
# summarising a weeks-long run stays seconds and a few hundred MB: ~400 bytes a row
# in Python lists, 640,000 rows took 2.3 s and 270 MB. Each rank gets an equal share,
# at least SAMPLE_MIN_STEPS, of which the newest SAMPLE_TAIL_STEPS are always dense
# (at most half the share). The floor is low so the budget holds at any scale: at
# 2,000 steps a rank, 4096 ranks read 8M rows (the final summary of a 240 s paced
# 4096-rank bench run took 64 s); at 256 they read 1M.
SAMPLE_BUDGET_ROWS = 1_000_000
SAMPLE_MIN_STEPS = 256
SAMPLE_TAIL_STEPS = 1_000


def load_run(
    conn: sqlite3.Connection,
    run: RunRef | None = None,
    *,
    last_n: int | None = None,
    live: bool = False,
    budget_rows: int | None = None,
) -> RunData:
    """The analysis engine's input for ``run`` (default: the latest run).

    ``last_n`` keeps only each rank's newest N steps (live views); ``budget_rows``
    bounds a whole-run read (see SAMPLE_BUDGET_ROWS); neither loads all.
    """
    run = run or latest_run(conn)
    if run is None:
        return RunData(ranks=[], live=live)
    ranks = load_ranks(conn, run)
    cap = None
    counts: dict[int, StepCounts] = {}
    if budget_rows is not None and last_n is None:
        cap = max(SAMPLE_MIN_STEPS, budget_rows // max(1, len(ranks)))
        counts = steps.step_counts(conn, [r.rank_id for r in ranks])
    datas = [load_rank_data(conn, r, last_n, cap, counts.get(r.rank_id)) for r in ranks]
    parallelism = run_parallelism(conn, run, (r.parallelism for r in ranks))
    if parallelism == "fsdp2":
        fsdp2.fill_steps(conn, [(r.rank_id, d) for r, d in zip(ranks, datas, strict=True)])
    return RunData(
        ranks=datas,
        parallelism=parallelism,
        now=time.time() if live else None,
        live=live,
        systems=load_systems(conn, run, ranks=ranks),
        nonfinite=load_nonfinite(conn, ranks),
        fingerprints=fingerprints.evidence(conn, run),
    )


def load_nonfinite(conn: sqlite3.Connection, ranks: list[RankRow]) -> list[NonFinite]:
    """The first non-finite value of each of these ranks' scalar series (LOSS_NONFINITE)."""
    global_rank = {r.rank_id: int(r.global_rank if r.global_rank is not None else r.rank_id) for r in ranks}
    return [
        NonFinite(global_rank=global_rank[rank_id], name=name, step=step, value=value)
        for rank_id, name, step, value in detail.first_nonfinite_scalars(conn, list(global_rank))
    ]


def load_window_run(
    conn: sqlite3.Connection, window: int, now: float | None = None, run: RunRef | None = None
) -> RunData:
    """``run`` (default: ``current_run``) over each rank's newest ``window`` steps, read
    set-based (a few statements whatever the rank count), plus each node's newest
    ``window`` host and GPU samples (``load_systems``: two index seeks per rank).

    The TUI's analyzer reads this every few refreshes; call it inside a read
    transaction (``connect.snapshot``) for a consistent picture.
    """
    run = run or current_run(conn)
    if run is None:
        return RunData(ranks=[])
    rows = load_ranks(conn, run)
    ranks: dict[int, RankData] = {
        r.rank_id: RankData(
            global_rank=int(r.global_rank if r.global_rank is not None else r.rank_id),
            local_rank=r.local_rank,
            node_rank=r.node_rank,
            hostname=r.hostname,
            phases_ns={p: [] for p in PHASES},
        )
        for r in rows
    }
    by_rank: dict[int, list[tuple[Any, ...]]] = {}
    for row in steps.recent_steps(conn, run, window):
        by_rank.setdefault(row[0], []).append(row[1:])
    for rank_id, window_rows in by_rank.items():
        data = ranks.get(rank_id)
        if data is not None:
            window_rows.sort(key=lambda r: r[0])
            _fill_steps(data, window_rows)
    for row in steps.latest_status(conn, run):
        data = ranks.get(row[0])
        if data is not None:
            data.status = steps.status_from_row(row[1:])
    out = list(ranks.values())
    live = bool(out) and not all(r.status is not None and r.status.finished for r in out)
    # Only the newest ``window`` host and GPU samples per node, like the steps, which
    # keeps the read bounded at thousands of ranks of 8 GPUs each.
    systems = load_systems(conn, run, last_n=window, ranks=rows)
    parallelism = run_parallelism(conn, run, (r.parallelism for r in rows))
    if parallelism == "fsdp2":
        fsdp2.fill_steps(conn, list(ranks.items()))
    # Fingerprints of the window's steps only: the live read stays bounded on a long run.
    since = min((r.steps[0] for r in out if r.steps), default=None)
    return RunData(ranks=out, parallelism=parallelism, now=now if live else None, live=live, systems=systems,
                   fingerprints=fingerprints.evidence(conn, run, since_step=since))
