"""Read-only queries over a traceml database (stdlib sqlite3, WAL readers).

Readers open ``file:PATH?mode=ro`` so they never take the write lock and
never block the daemon's writer; the TUI, summary, export and compare all
load data through here.

    conn = open_readonly(path)             # raises StoreError naming the path
    run = latest_run(conn)                 # RunRef(session, attempt) or None
    ranks = load_ranks(conn, run)          # list[RankRow]
    data = load_run(conn, run, last_n=200) # analysis.model.RunData
    counters = delivery_counters(conn)     # flat summary counters
"""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass
from typing import Any

from traceml_daemon.analysis.model import PHASES, NodeSystem, RankData, RankStatus, RunData
from traceml_daemon.ingest.counters import AGENT_PREFIX, DAEMON_SOURCE, RELAY_PREFIX
from traceml_daemon.store.schema import RANK_COLUMNS, SCHEMA_VERSION, rank_is, ranks_in


class StoreError(RuntimeError):
    """The path is missing or is not a readable traceml database."""


@dataclass(frozen=True)
class RunRef:
    session: str
    attempt: int


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


def open_readonly(path: str) -> sqlite3.Connection:
    """Open ``path`` read-only and check it is a traceml database of a known version."""
    if not os.path.exists(path):
        raise StoreError(f"{path}: no such database (start `traceml-daemon serve --db {path}` first)")
    try:
        conn = sqlite3.connect(f"file:{os.path.abspath(path)}?mode=ro", uri=True)
        version = schema_version(conn)
    except sqlite3.Error as exc:
        raise StoreError(f"{path}: not a traceml database ({exc})") from None
    if version is None:
        conn.close()
        raise StoreError(f"{path}: not a traceml database (no schema_version)")
    if version > SCHEMA_VERSION:
        conn.close()
        raise StoreError(f"{path}: schema version {version} is newer than this traceml-daemon ({SCHEMA_VERSION}); upgrade")
    return conn


def schema_version(conn: sqlite3.Connection) -> int | None:
    try:
        row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    except sqlite3.OperationalError:
        return None
    return int(row[0]) if row else None


def latest_run(conn: sqlite3.Connection) -> RunRef | None:
    """The session seen most recently, at its highest attempt (torchelastic restarts)."""
    row = conn.execute(
        "SELECT session FROM ranks GROUP BY session ORDER BY max(coalesce(last_seen, first_seen, 0)) DESC LIMIT 1"
    ).fetchone()
    if row is None:
        return None
    (attempt,) = conn.execute("SELECT max(attempt) FROM ranks WHERE session=?", (row[0],)).fetchone()
    return RunRef(row[0], int(attempt or 0))


def list_runs(conn: sqlite3.Connection) -> list[RunRef]:
    rows = conn.execute(
        "SELECT session, attempt FROM ranks GROUP BY session, attempt ORDER BY min(first_seen)"
    ).fetchall()
    return [RunRef(s, int(a)) for s, a in rows]


def load_ranks(conn: sqlite3.Connection, run: RunRef) -> list[RankRow]:
    rows = conn.execute(
        _RANK_SELECT + " WHERE session=? AND attempt=? ORDER BY global_rank, rank_id", (run.session, run.attempt)
    ).fetchall()
    return [RankRow(*row) for row in rows]


def run_bounds(conn: sqlite3.Connection, run: RunRef) -> tuple[float | None, float | None]:
    """(started_at, ended_at) wall clock: first and last step end, else first/last seen.

    Each rank's first and last step through the steps index, two lookups per rank:
    ``min(ts)`` over the run's rows read every row of a long run."""
    ends = conn.execute(
        f"SELECT (SELECT ts FROM steps WHERE {rank_is('r.rank_id')} ORDER BY step LIMIT 1), "
        f"(SELECT ts FROM steps WHERE {rank_is('r.rank_id')} ORDER BY step DESC LIMIT 1) "
        "FROM ranks r WHERE r.session=? AND r.attempt=?",
        (run.session, run.attempt),
    ).fetchall()
    firsts = [a for a, _ in ends if a is not None]
    lasts = [b for _, b in ends if b is not None]
    seen = conn.execute(
        "SELECT min(first_seen), max(last_seen) FROM ranks WHERE session=? AND attempt=?", (run.session, run.attempt)
    ).fetchone()
    return (min(firsts) if firsts else seen[0], max(lasts) if lasts else seen[1])


_STEP_COLS = ("step", "ts", "step_ns", *(f"{p}_ns" for p in PHASES), "comm_ns", "peak_bytes", "reserved_bytes", "rss_bytes")


def _rank_steps(conn: sqlite3.Connection, rank_id: int, last_n: int | None) -> list[tuple[Any, ...]]:
    cols = ", ".join(_STEP_COLS)
    if last_n is None:
        return conn.execute(f"SELECT {cols} FROM steps WHERE {rank_is('?1')} ORDER BY step", (rank_id,)).fetchall()
    # Newest N through the steps index, then back to oldest-first.
    rows = conn.execute(
        f"SELECT {cols} FROM steps WHERE {rank_is('?1')} ORDER BY step DESC LIMIT ?2", (rank_id, last_n)
    ).fetchall()
    rows.reverse()
    return rows


@dataclass(frozen=True)
class StepCounts:
    """A rank's stored steps, counted in SQL (index only): exact however many were loaded."""

    total: int
    first: int | None
    last: int | None


# Rank ids per statement of _step_counts_many: two parameters' worth of SQL each,
# well inside SQLite's 32,766 bound parameters.
_COUNT_CHUNK = 4096


def _step_counts(conn: sqlite3.Connection, rank_id: int) -> StepCounts:
    return _step_counts_many(conn, [rank_id])[rank_id]


def _step_counts_many(conn: sqlite3.Connection, rank_ids: list[int]) -> dict[int, StepCounts]:
    """Each rank's stored steps (count, first, last) in one pass over their groups' index
    entries: a count per rank walks its whole group (schema v4), so one statement per
    rank of a group would walk it RANK_GROUP times."""
    out = dict.fromkeys(rank_ids, StepCounts(0, None, None))
    for i in range(0, len(rank_ids), _COUNT_CHUNK):
        part = rank_ids[i : i + _COUNT_CHUNK]
        for rank_id, total, first, last in conn.execute(
            f"SELECT rank_id, count(*), min(step), max(step) FROM steps WHERE {ranks_in(len(part))} GROUP BY rank_id",
            part,
        ):
            out[rank_id] = StepCounts(total, first, last)
    return out


# Step numbers per statement when fetching chosen steps of a rank.
_IN_CHUNK = 500


def _sampled_steps(conn: sqlite3.Connection, rank_id: int, counts: StepCounts, cap: int, tail: int) -> list[tuple[Any, ...]]:
    """At most about ``cap`` rows of a rank: every k-th step over the whole run (creep and
    whole-run medians keep their shape under uniform thinning) plus the newest ``tail``
    steps dense (the windows the step verdicts and liveness read). The first and the
    last step are always in it, so only the count needs ``counts``."""
    if counts.total <= cap or counts.first is None or counts.last is None:
        return _rank_steps(conn, rank_id, None)
    tail = max(1, min(tail, cap // 2))  # at least half the budget samples the whole run
    every = -(-counts.total // max(1, cap - tail))
    if counts.last - counts.first + 1 == counts.total:
        # Contiguous step numbers (the usual case): the chosen steps by arithmetic, each
        # a seek of the index. (A filter ``(step - first) % every = 0`` would walk every
        # entry of the rank's group, RANK_GROUP x the rank's own.)
        chosen = sorted({*range(counts.first, counts.last + 1, every), *range(counts.last - tail + 1, counts.last + 1)})
    else:
        # Gaps or a stride (e.g. one row per optimizer step of accumulated micro-steps),
        # where every k-th step number could alias and select nothing: every k-th of the
        # steps themselves, read from the index.
        steps = [row[0] for row in conn.execute(f"SELECT step FROM steps WHERE {rank_is('?1')} ORDER BY step", (rank_id,))]
        chosen = sorted(set(steps[::every]) | set(steps[-tail:]))
    cols = ", ".join(_STEP_COLS)
    rows: list[tuple[Any, ...]] = []
    for i in range(0, len(chosen), _IN_CHUNK):
        part = chosen[i : i + _IN_CHUNK]
        rows += conn.execute(
            f"SELECT {cols} FROM steps WHERE {rank_is('?1')} AND step IN ({','.join('?' * len(part))}) ORDER BY step",
            (rank_id, *part),
        ).fetchall()
    return rows


def _rank_status(conn: sqlite3.Connection, rank_id: int) -> RankStatus | None:
    row = conn.execute(
        "SELECT ts, phase, phase_since, step, steps_done, finished FROM status WHERE rank_id=? ORDER BY ts DESC LIMIT 1",
        (rank_id,),
    ).fetchone()
    if row is None or row[0] is None:
        return None
    ts, phase, since, step, done, finished = row
    return RankStatus(ts, phase or "idle", since if since is not None else ts, step, done or 0, bool(finished))


def load_rank_data(
    conn: sqlite3.Connection,
    rank: RankRow,
    last_n: int | None = None,
    cap: int | None = None,
    counts: StepCounts | None = None,
) -> RankData:
    """One rank's steps: all, the newest ``last_n``, or (``cap``) a bounded sample of a long run
    (``counts``: the rank's, when already read with others by ``_step_counts_many``)."""
    data = RankData(
        global_rank=rank.global_rank if rank.global_rank is not None else -rank.rank_id,
        local_rank=rank.local_rank,
        node_rank=rank.node_rank,
        hostname=rank.hostname,
    )
    if cap is not None:
        counts = counts or _step_counts(conn, rank.rank_id)
        data.steps_stored = counts.total
        rows = _sampled_steps(conn, rank.rank_id, counts, cap, SAMPLE_TAIL_STEPS)
    else:
        rows = _rank_steps(conn, rank.rank_id, last_n)
    if rows:
        columns = list(zip(*rows, strict=True))
        by = dict(zip(_STEP_COLS, columns, strict=True))
        data.steps = list(by["step"])
        data.step_ts = list(by["ts"])
        data.step_ns = list(by["step_ns"])
        data.phases_ns = {p: list(by[f"{p}_ns"]) for p in PHASES}
        data.comm_ns = list(by["comm_ns"])
        data.peak_bytes = list(by["peak_bytes"])
        data.reserved_bytes = list(by["reserved_bytes"])
        data.rss_bytes = list(by["rss_bytes"])
    else:
        data.phases_ns = {p: [] for p in PHASES}
    data.status = _rank_status(conn, rank.rank_id)
    return data


def load_systems(conn: sqlite3.Connection, run: RunRef, last_n: int = 120) -> list[NodeSystem]:
    """Latest host and GPU samples per node (reported by each node's local rank 0)."""
    out: dict[int, NodeSystem] = {}
    for rank in load_ranks(conn, run):
        if rank.node_rank is None:
            continue
        node = out.setdefault(rank.node_rank, NodeSystem(node_rank=rank.node_rank, hostname=rank.hostname))
        rows = conn.execute(
            f"SELECT cpu_pct, mem_used_bytes, mem_total_bytes FROM system WHERE {rank_is('?1')} ORDER BY ts DESC LIMIT ?2",
            (rank.rank_id, last_n),
        ).fetchall()[::-1]
        if rows:
            node.cpu_pct = [r[0] for r in rows]
            node.mem_used_bytes = [r[1] for r in rows]
            node.mem_total_bytes = rows[-1][2]
        gpu_rows = conn.execute(
            f"SELECT gpu_index, util_pct, temp_c, mem_used_bytes, mem_total_bytes FROM gpu WHERE {rank_is('?1')} "
            "ORDER BY ts DESC LIMIT ?2",
            (rank.rank_id, last_n * 8),
        ).fetchall()[::-1]
        for idx, util, temp, used, total in gpu_rows:
            if idx is None:
                continue
            node.gpu_util_pct.setdefault(idx, []).append(util)
            node.gpu_temp_c.setdefault(idx, []).append(temp)
            node.gpu_mem_used_bytes.setdefault(idx, []).append(used)
            node.gpu_mem_total_bytes[idx] = total
    return [out[k] for k in sorted(out)]


def run_parallelism(conn: sqlite3.Connection, run: RunRef, ranks: list[RankRow] | None = None) -> str:
    """fsdp2 > ddp > single, from the traced models, else the hello identity."""
    found = {
        row[0]
        for row in conn.execute(
            "SELECT DISTINCT m.parallelism FROM models m JOIN ranks r USING (rank_id) WHERE r.session=? AND r.attempt=?",
            (run.session, run.attempt),
        )
    }
    found |= {r.parallelism for r in (ranks if ranks is not None else load_ranks(conn, run))}
    for kind in ("fsdp2", "ddp"):
        if kind in found:
            return kind
    return "single"


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
        counts = _step_counts_many(conn, [r.rank_id for r in ranks])
    return RunData(
        ranks=[load_rank_data(conn, r, last_n, cap, counts.get(r.rank_id)) for r in ranks],
        parallelism=run_parallelism(conn, run, ranks),
        now=time.time() if live else None,
        live=live,
        systems=load_systems(conn, run),
    )


def fsdp2_memory(conn: sqlite3.Connection, rank_id: int) -> dict[str, int] | None:
    row = conn.execute(
        "SELECT local_shard_bytes, estimated_full_bytes FROM models WHERE rank_id=? AND parallelism='fsdp2' "
        "AND local_shard_bytes IS NOT NULL ORDER BY rowid DESC LIMIT 1",
        (rank_id,),
    ).fetchone()
    if row is None:
        return None
    return {"local_shard_bytes": row[0], "estimated_full_bytes": row[1]}


# Agent counters that are lost rows (each unit one row or one step row) and
# lost batches (each an unknown number of rows). Everything else an agent
# reports (errors, fallbacks) is informative, summed under ``agent_<name>``:
# ``device_steps_dropped`` / ``device_steps_fallback`` / ``device_steps_overflow``
# are steps whose device events timed out, were lost or were given up, and which
# were stored with their host timings; ``steps_dropped`` are CPU steps the
# tracer's bounded queue discarded (no row); ``sender_oversize_rows`` are rows
# too large for any batch.
AGENT_ROW_DROPS = ("recorder_rows", "steps_dropped", "scalars_dropped", "sender_oversize_rows")
AGENT_BATCH_DROPS = ("sender_batches",)
RELAY_BATCH_DROPS = ("dropped_batches",)


def delivery_counters(conn: sqlite3.Connection) -> dict[str, int]:
    """Flat counters for the summary: the daemon's own; rows and batches that an
    agent or relay reported lost; every other agent and relay counter summed
    under ``agent_<counter>`` / ``relay_<counter>``."""
    out: dict[str, int] = {
        "frames_received": 0,
        "rows_stored": 0,
        "rows_dropped_reported": 0,
        "batches_dropped_reported": 0,
        "duplicates_discarded": 0,
        "oversize_frames": 0,
        "refused_peers": 0,
    }
    # Summed per kind of source in SQL: with thousands of senders the table holds
    # tens of thousands of rows and the TUI reads this while a run is live.
    by_kind = conn.execute(
        "SELECT CASE WHEN source = ? THEN 'daemon' WHEN substr(source, 1, ?) = ? THEN 'agent' "
        "WHEN substr(source, 1, ?) = ? THEN 'relay' END AS kind, counter, sum(value) "
        "FROM delivery GROUP BY kind, counter HAVING kind IS NOT NULL",
        (DAEMON_SOURCE, len(AGENT_PREFIX), AGENT_PREFIX, len(RELAY_PREFIX), RELAY_PREFIX),
    )
    for kind, counter, value in by_kind:
        if kind == "daemon":
            out[counter] = value
            continue
        if kind == "agent":
            if counter in AGENT_ROW_DROPS:
                out["rows_dropped_reported"] += value
            elif counter in AGENT_BATCH_DROPS:
                out["batches_dropped_reported"] += value
        elif counter in RELAY_BATCH_DROPS:
            out["batches_dropped_reported"] += value
        name = f"{kind}_{counter}"
        out[name] = out.get(name, 0) + value
    return out
