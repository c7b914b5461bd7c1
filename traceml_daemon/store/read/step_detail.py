"""Everything one rank recorded at one step: ``traceml-daemon inspect`` and the TUI's step inspector.

Each read is a seek of its table's per-rank index: the step's rows (steps,
layers), the value of each scalar name at the step (one seek per name), the
spans and output lines inside the step's time window, and the process, host
and GPU samples nearest the step's end. Nothing here walks a run.
"""

from __future__ import annotations

import math
import sqlite3
from dataclasses import dataclass, field
from typing import Any

from traceml_daemon.analysis.model import PHASES, RankData, RankStatus, RunData
from traceml_daemon.analysis.policy import Policy
from traceml_daemon.analysis.step_band import OutOfBand, out_of_band
from traceml_daemon.store.read import detail, steps
from traceml_daemon.store.read.output import has_output, output_between
from traceml_daemon.store.read.rollouts import ProfileFile, run_profiles
from traceml_daemon.store.read.runs import RunRef, run_parallelism
from traceml_daemon.store.reader import RankRow, load_ranks
from traceml_daemon.store.schema import rank_is

# A span that began this long before the step and still ran during it is missed: the
# bound keeps the read an index range of the spans near the step.
SPAN_HORIZON_S = 600.0
MAX_SPANS = 200
MAX_SCALARS = 64
MAX_OUTPUT_LINES = 200

# Columns of each sampled table, as returned (``ts`` first).
_SAMPLE_COLS = {
    "process": ("ts", "cpu_pct", "rss_bytes", "gpu_mem_bytes", "threads"),
    "system": ("ts", "cpu_pct", "mem_used_bytes", "mem_total_bytes", "net_rx_bps", "net_tx_bps",
               "disk_read_bps", "disk_write_bps"),
}
_GPU_COLS = ("ts", "gpu_index", "util_pct", "mem_used_bytes", "mem_total_bytes", "temp_c", "power_w")


@dataclass
class RankStep:
    """One rank at one step; every sample is a dict of column to value."""

    rank_id: int
    rows: list[dict[str, Any]] = field(default_factory=list)  # steps rows (one per traced model)
    scalars: dict[str, float | None] = field(default_factory=dict)
    spans: list[dict[str, Any]] = field(default_factory=list)
    layers: list[dict[str, Any]] = field(default_factory=list)
    status: RankStatus | None = None
    process: dict[str, Any] | None = None
    host: dict[str, Any] | None = None
    gpus: list[dict[str, Any]] = field(default_factory=list)
    output: list[dict[str, Any]] = field(default_factory=list)

    @property
    def recorded(self) -> bool:
        return bool(self.rows)

    def window(self) -> tuple[float, float] | None:
        """Wall-clock seconds [start, end] of the step: its end less its step and dataloader
        time (the fetch before the step belongs to it), or None when not recorded."""
        # A ts that is no time (a peer sent inf or NaN, stored as such) places nothing.
        ends = [r["ts"] for r in self.rows if isinstance(r.get("ts"), (int, float)) and math.isfinite(r["ts"])]
        if not ends:
            return None
        end = max(ends)
        longest = max(((r.get("step_ns") or 0) + (r.get("dataloader_ns") or 0) for r in self.rows), default=0)
        return end - longest / 1e9, end


def step_rows(conn: sqlite3.Connection, rank_id: int, step: int) -> list[dict[str, Any]]:
    cols = steps.STEP_COLS
    return [
        dict(zip(cols, row, strict=True))
        for row in conn.execute(
            f"SELECT {', '.join(cols)} FROM steps WHERE {rank_is('?1')} AND step=?2 ORDER BY rowid", (rank_id, step)
        )
    ]


def scalars_at(conn: sqlite3.Connection, rank_id: int, step: int) -> dict[str, float | None]:
    """The value of each scalar the rank logged at ``step`` (its first ``MAX_SCALARS`` names)."""
    out: dict[str, float | None] = {}
    for name in detail.scalar_names(conn, rank_id, MAX_SCALARS):
        row = conn.execute(
            f"SELECT value FROM scalars WHERE {rank_is('?1')} AND name=?2 AND step=?3 LIMIT 1", (rank_id, name, step)
        ).fetchone()
        if row is not None:
            out[name] = detail.stored_real(row[0])
    return out


def layers_at(conn: sqlite3.Connection, rank_id: int, step: int) -> list[dict[str, Any]]:
    cols = ("layer", "forward_ns", "backward_ns", "activation_bytes")
    return [
        dict(zip(cols, row, strict=True))
        for row in conn.execute(
            f"SELECT {', '.join(cols)} FROM layers WHERE {rank_is('?1')} AND step=?2 ORDER BY rowid", (rank_id, step)
        )
    ]


def spans_during(conn: sqlite3.Connection, rank_id: int, t0: float, t1: float) -> list[dict[str, Any]]:
    """Spans overlapping [t0, t1] (seconds) and instants inside it, by start."""
    lo, hi = int(t0 * 1e9), int(t1 * 1e9)
    cols = ("name", "start_ns", "dur_ns", "step", "args")
    return [
        dict(zip(cols, row, strict=True))
        for row in conn.execute(
            f"SELECT {', '.join(cols)} FROM spans WHERE {rank_is('?1')} AND start_ns BETWEEN ?2 AND ?3 "
            "AND start_ns + COALESCE(dur_ns, 0) >= ?4 ORDER BY start_ns LIMIT ?5",
            (rank_id, lo - int(SPAN_HORIZON_S * 1e9), hi, lo, MAX_SPANS),
        )
    ]


def nearest_sample(conn: sqlite3.Connection, table: str, rank_id: int, ts: float) -> dict[str, Any] | None:
    """The ``process`` or ``system`` sample of the rank nearest ``ts`` (one seek either side)."""
    cols = _SAMPLE_COLS[table]
    select = f"SELECT {', '.join(cols)} FROM {table} WHERE {rank_is('?1')}"
    before = conn.execute(f"{select} AND ts <= ?2 ORDER BY ts DESC LIMIT 1", (rank_id, ts)).fetchone()
    after = conn.execute(f"{select} AND ts > ?2 ORDER BY ts LIMIT 1", (rank_id, ts)).fetchone()
    best = min((r for r in (before, after) if r is not None), key=lambda r: abs(r[0] - ts), default=None)
    return None if best is None else dict(zip(cols, best, strict=True))


def nearest_gpus(conn: sqlite3.Connection, rank_id: int, ts: float) -> list[dict[str, Any]]:
    """Every GPU's sample taken at the GPU sampling instant nearest ``ts``."""
    near = [
        row[0]
        for row in (
            conn.execute(f"SELECT ts FROM gpu WHERE {rank_is('?1')} AND ts <= ?2 ORDER BY ts DESC LIMIT 1",
                         (rank_id, ts)).fetchone(),
            conn.execute(f"SELECT ts FROM gpu WHERE {rank_is('?1')} AND ts > ?2 ORDER BY ts LIMIT 1",
                         (rank_id, ts)).fetchone(),
        )
        if row is not None
    ]
    if not near:
        return []
    at = min(near, key=lambda t: abs(t - ts))
    return [
        dict(zip(_GPU_COLS, row, strict=True))
        for row in conn.execute(
            f"SELECT {', '.join(_GPU_COLS)} FROM gpu WHERE {rank_is('?1')} AND ts=?2 ORDER BY gpu_index", (rank_id, at)
        )
    ]


def rank_step(conn: sqlite3.Connection, rank_id: int, step: int) -> RankStep:
    """Everything the rank recorded at ``step`` (samples: those nearest the step's end)."""
    out = RankStep(rank_id, rows=step_rows(conn, rank_id, step))
    out.status = steps.rank_status(conn, rank_id)
    out.scalars = scalars_at(conn, rank_id, step)
    out.layers = layers_at(conn, rank_id, step)
    window = out.window()
    if window is None:
        return out
    t0, t1 = window
    out.spans = spans_during(conn, rank_id, t0, t1)
    out.process = nearest_sample(conn, "process", rank_id, t1)
    out.host = nearest_sample(conn, "system", rank_id, t1)
    out.gpus = nearest_gpus(conn, rank_id, t1)
    if has_output(conn):
        cols = ("ts", "stream", "seq", "line")
        out.output = [dict(zip(cols, r, strict=True)) for r in output_between(conn, rank_id, t0, t1, MAX_OUTPUT_LINES)]
    return out


# ---------------------------------------------------------------- every rank of a run at one step


class StepNotFound(LookupError):
    """No rank of the run recorded the step; the message says which steps exist."""


class RankNotFound(LookupError):
    """``--rank`` names a rank the run does not have; the message lists those it has."""


@dataclass
class StepView:
    """Every rank of ``run`` at ``step``, by global rank, and the ranks outside the band."""

    run: RunRef
    step: int
    parallelism: str
    ranks: list[tuple[RankRow, RankStep]]
    out_of_band: list[OutOfBand]
    first_step: int | None  # the steps stored, over the run's ranks
    last_step: int | None
    profiles: list[ProfileFile] = field(default_factory=list)  # torch.profiler traces covering the step


def _global(row: RankRow) -> int:
    return int(row.global_rank if row.global_rank is not None else -row.rank_id)


def load_step(
    conn: sqlite3.Connection, run: RunRef, step: int, rank: int | None = None, policy: Policy | None = None
) -> StepView:
    """Read ``step`` of every rank of ``run``: the step rows of all (the band needs them),
    everything else for ``rank`` only when given. Raises StepNotFound, RankNotFound."""
    from traceml_daemon.analysis.stats import rank_ranges

    rows = load_ranks(conn, run)
    if rank is not None and all(_global(r) != rank for r in rows):
        raise RankNotFound(f"rank {rank} is not in session {run.session} (ranks {rank_ranges(_global(r) for r in rows)})")
    bounds = [(first, last) for _, first, last in steps.step_bounds(conn, run) if first is not None]
    first = min((b[0] for b in bounds), default=None)
    last = max((b[1] for b in bounds), default=None)
    ranks: list[tuple[RankRow, RankStep]] = []
    for row in rows:
        if rank is None or _global(row) == rank:
            ranks.append((row, rank_step(conn, row.rank_id, step)))
        else:
            ranks.append((row, RankStep(row.rank_id, rows=step_rows(conn, row.rank_id, step))))
    if not any(rs.recorded for _, rs in ranks):
        stored = "no steps are stored yet" if first is None else f"steps {first}-{last} are stored"
        raise StepNotFound(f"step {step} is not stored for session {run.session}: {stored}")
    parallelism = run_parallelism(conn, run, (r.parallelism for r in rows))
    band = RunData(ranks=[_rank_data(row, rs, step) for row, rs in ranks if rs.recorded], parallelism=parallelism)
    covering = [
        p for p in run_profiles(conn, [(r.rank_id, r.global_rank) for r in rows])
        if p.step is not None and p.step <= step < p.step + max(1, p.steps or 1)
    ]
    return StepView(run, step, parallelism, ranks, out_of_band(band, policy), first, last, covering)


def _rank_data(row: RankRow, rs: RankStep, step: int) -> RankData:
    """The rank's step as the analysis engine's input (its first traced model's row)."""
    r = rs.rows[0]
    return RankData(
        global_rank=_global(row), local_rank=row.local_rank, node_rank=row.node_rank, hostname=row.hostname,
        steps=[step], step_ns=[r["step_ns"]], phases_ns={p: [r[f"{p}_ns"]] for p in PHASES},
        comm_ns=[r["comm_ns"]], peak_bytes=[r["peak_bytes"]], reserved_bytes=[r["reserved_bytes"]],
        rss_bytes=[r["rss_bytes"]], step_ts=[r["ts"]],
    )
