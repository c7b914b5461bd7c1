"""Open a finished 1,000,000-step x 64-rank run and produce the TUI overview.

Building 64M raw step rows (about 6 GB, minutes of inserts) is more than this
2-core machine can do for a benchmark, so the database is built like this,
and the figures say so:

* history tables (``rank_history``, ``node_history``, ``reservoir``) for all
  1M x 64 steps, through the functions the writer's history writes run
  (``history.bucket_deltas`` and ``Reservoir.offer`` take named columns and call
  the writer's ``add_rank_deltas`` and ``offer_columns``; ``node_deltas``) and
  the same upsert statements, one simulated write per 16,384 steps of every rank;
* raw ``steps`` only for the newest ``--raw-tail`` steps per rank (what a
  retention policy would keep), inserted with plain sqlite3 ``executemany``.

Figure: time to open the database read-only and build the overview (header,
per-rank medians, node table, step-time series of <= width points) with
``history.overview``. Same-run baseline: the naive way, a full scan of the raw
``steps`` present (GROUP BY rank, bucket), timed and extrapolated per row to
the 64M rows the run would hold.

    python bench/history.py                      # 1,000,000 steps x 64 ranks
    python bench/history.py --steps 100000       # quicker

Ends with one JSON line holding every figure.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from traceml_daemon.store import history  # noqa: E402
from traceml_daemon.store.migrate import migrate  # noqa: E402
from traceml_daemon.store.reader import open_readonly  # noqa: E402
from traceml_wire.tables import PHASES, columns  # noqa: E402

CHUNK = 16384  # steps per rank per simulated transaction


def _cols(rank: int, first: int, n: int) -> dict[str, list[Any]]:
    steps = list(range(first, first + n))
    # Deterministic, cheap variation; rank 5 is a mild straggler.
    base = 20_000_000 + (3_000_000 if rank == 5 else 0)
    cols: dict[str, list[Any]] = {"step": steps, "ts": [1.7e9 + s * 0.02 for s in steps]}
    cols["step_ns"] = [base + (s * 7919 + rank * 104_729) % 4_000_000 for s in steps]
    for j, p in enumerate(PHASES):
        cols[f"{p}_ns"] = [1_000_000 * (j + 1) + (s * 31 + rank) % 500_000 for s in steps]
    return cols


def build(path: str, steps: int, ranks: int, raw_tail: int) -> dict[str, float]:
    migrate(path)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA synchronous=OFF")
    conn.execute("BEGIN")
    for r in range(ranks):
        conn.execute(
            "INSERT INTO ranks (rank_id, sender, session, attempt, global_rank, local_rank, node_rank, hostname, "
            "last_seq) VALUES (?, ?, 'bench', 0, ?, ?, ?, ?, 0)",
            (r + 1, f"bench/a0/n{r // 8}/r{r}/1-x", r, r % 8, r // 8, f"node{r // 8}"),
        )
    conn.execute("COMMIT")
    res = history.Reservoir()
    t0 = time.perf_counter()
    for first in range(0, steps, CHUNK):
        n = min(CHUNK, steps - first)
        by_rank = {r + 1: _cols(r, first, n) for r in range(ranks)}
        deltas = history.bucket_deltas(by_rank)
        nodes = history.node_deltas(deltas, lambda rid: ("bench", 0, (rid - 1) // 8))
        update = history.ReservoirUpdate()
        for rid, cols in by_rank.items():
            res.offer(rid, cols, update)
        rows, states = history.reservoir_rows(update)
        conn.execute("BEGIN")
        conn.executemany(history.RANK_UPSERT, history.history_rows(deltas))
        conn.executemany(history.NODE_UPSERT, history.history_rows(nodes))
        conn.executemany(history.RESERVOIR_UPSERT, rows)
        conn.executemany(history.RESERVOIR_STATE_UPSERT, states)
        if first + n > steps - raw_tail:
            order = columns("steps")
            sql = f"INSERT INTO steps (rank_id, {', '.join(order)}) VALUES ({', '.join('?' * (len(order) + 1))})"
            for rid, cols in by_rank.items():
                lo = max(0, steps - raw_tail - first)
                conn.executemany(sql, zip([rid] * (n - lo), *(cols.get(c, [None] * n)[lo:] for c in order),
                                          strict=True))
        conn.execute("COMMIT")
    built = time.perf_counter() - t0
    conn.close()
    return {"build_s": built, "history_steps_per_s": steps * ranks / built}


def measure(path: str, width: int, steps: int, ranks: int) -> dict[str, float]:
    t0 = time.perf_counter()
    conn = open_readonly(path)
    ov = history.overview(conn, "bench", 0, width=width)
    t_overview = time.perf_counter() - t0
    rows_read = len(ov.series) + sum(len(s) for s in ov.node_series.values())
    conn.close()
    # Baseline: the naive overview, a full GROUP BY scan of the raw rows present.
    t0 = time.perf_counter()
    conn = open_readonly(path)
    raw_rows = conn.execute("SELECT count(*) FROM steps").fetchone()[0]
    conn.execute(
        "SELECT rank_id, step / 1024, min(step_ns), avg(step_ns), max(step_ns) FROM steps GROUP BY rank_id, step / 1024"
    ).fetchall()
    conn.close()
    t_scan = time.perf_counter() - t0
    full = steps * ranks
    t_scan_full = t_scan * full / max(1, raw_rows)
    print(f"overview of {steps:,} steps x {ranks} ranks from history: {1000 * t_overview:.1f} ms "
          f"(level {ov.level}, {len(ov.series)} series points, {len(ov.ranks)} ranks, {len(ov.nodes)} nodes)")
    print(f"baseline naive full scan: {1000 * t_scan:.1f} ms for the {raw_rows:,} raw rows present; "
          f"extrapolated to {full:,} rows: {t_scan_full:.1f} s; ratio overview/full-scan {t_overview / t_scan_full:.5f}")
    return {"overview_ms": 1000 * t_overview, "series_points": len(ov.series), "node_points": rows_read,
            "level": ov.level, "baseline_scan_ms": 1000 * t_scan, "baseline_raw_rows": raw_rows,
            "baseline_scan_extrapolated_s": t_scan_full, "ratio": t_overview / t_scan_full}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--raw-tail", type=int, default=10_000, help="raw steps kept per rank (the newest)")
    p.add_argument("--width", type=int, default=200, help="points per series (terminal columns)")
    p.add_argument("--db", help="reuse/keep this database (built when missing)")
    args = p.parse_args()
    path = args.db or str(Path(tempfile.mkdtemp(prefix="traceml-history-")) / "history.db")
    figures: dict[str, float] = {}
    if not Path(path).exists():
        figures.update(build(path, args.steps, args.ranks, args.raw_tail))
        print(f"built history for {args.steps:,} x {args.ranks} steps in {figures['build_s']:.1f} s "
              f"({figures['history_steps_per_s']:,.0f} steps/s through the writer's history functions; "
              f"raw rows only for the newest {args.raw_tail:,} steps per rank)")
    figures.update(measure(path, args.width, args.steps, args.ranks))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
