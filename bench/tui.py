"""TUI benchmark: time to first paint and per-refresh cost at 2, 1024 and 4096 ranks,
and time to first paint of a long finished run read through the history tables.

For each size a synthetic live run (a few hundred steps per rank) is written
with the real schema. Measured:

* first paint: from constructing the app to the first completed refresh
  painted (``run_test`` at 200x50);
* refresh: one new step for every rank is written (untimed), then the time
  for the worker's read plus the widget update (the app's own counters);
  median over the rounds; also the time until painted, seen from the pilot,
  and that less the 2-rank run's (Textual's frame and the pilot's polling);
* data: the data module's ``overview()`` alone on the same new rows, and its
  ``changed()`` (the app's ten-times-a-second "anything committed?" poll) when
  nothing is new;
* baseline: a plain sqlite3 read of the same recent window without the
  incremental cursors (``WHERE step > latest - 32``, a scan), in the same run;
* analysis: ``Analyzer.run()`` (diagnosis + node views), which the app runs in
  its own worker every 5th refresh, off the refresh path.

History: a database built with ``bench/history.py``'s builder (history tables
for every step, raw steps only for the newest ``--history-raw-tail`` per rank),
``--history-steps`` x ``--history-ranks`` (default 200,000 x 64; pass
1000000 for the design's figure: the build takes minutes on 2 cores). Measured:
the app's first paint on it, and ``TuiData.overview()`` alone. Same-run
baselines: the app's first paint on a 2-rank run (Textual's own start-up) and
the naive overview, a full GROUP BY scan of the raw rows present, extrapolated
per row to the whole run (as ``bench/history.py`` does).

Targets (docs/DESIGN): refresh at 1024 ranks <= 50 ms; open a finished
1,000,000 x 64 run and draw the overview <= 1 s. Ends with one JSON line.

    .venv/bin/python bench/tui.py [--sizes 2,1024,4096] [--steps 300] [--rounds 15]
        [--history-steps 200000] [--history-ranks 64]   # --history-steps 0 skips it
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.synth_db import T0, SynthSpec, build, step_row  # noqa: E402
from traceml_daemon.tui.analyzer import Analyzer  # noqa: E402
from traceml_daemon.tui.app import TraceApp  # noqa: E402
from traceml_daemon.tui.data import TuiData  # noqa: E402

_INSERT = "INSERT INTO steps VALUES (" + ",".join("?" * 15) + ")"


def _append_step(db: str, world: int, step: int) -> None:
    con = sqlite3.connect(db)
    con.executemany(_INSERT, [step_row(g + 1, g, step, 3) for g in range(world)])
    con.execute("UPDATE ranks SET last_seen=?", (T0 + step * 0.05,))
    con.commit()
    con.close()


def _baseline(db: str) -> float:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    t = time.perf_counter()
    (hi,) = con.execute("SELECT MAX(step) FROM steps").fetchone()
    con.execute("SELECT * FROM steps WHERE step > ?", (hi - 32,)).fetchall()
    dt = time.perf_counter() - t
    con.close()
    return dt


async def _wait(pilot: object, app: TraceApp, n: int) -> None:
    while app.refresh_count < n or app._busy:
        await pilot.pause(0.001)  # type: ignore[attr-defined]
    await pilot.pause()  # type: ignore[attr-defined]


async def _first_paint(db: str, now: float) -> float:
    t0 = time.perf_counter()
    app = TraceApp(db, clock=lambda: now, refresh_s=0)
    async with app.run_test(size=(200, 50)) as pilot:
        await _wait(pilot, app, 1)
        first = time.perf_counter() - t0
        await app.workers.wait_for_complete()
    return first


async def _measure_app(db: str, world: int, steps: int, rounds: int) -> tuple[float, list[float], list[float]]:
    now = T0 + steps * 0.05
    t0 = time.perf_counter()
    app = TraceApp(db, clock=lambda: now, refresh_s=0)
    refresh: list[float] = []
    painted: list[float] = []
    async with app.run_test(size=(200, 50)) as pilot:
        await _wait(pilot, app, 1)
        first = time.perf_counter() - t0
        # The first analysis runs beside the first refresh; let it finish so the
        # rounds below see the steady state (one analysis every 5th refresh).
        await app.workers.wait_for_complete()
        for i in range(rounds):
            # The analysis worker (every 5th refresh, <= 1/5 of the time) shares the GIL;
            # at 1 refresh/s it rarely overlaps one, so rounds start with it idle here.
            await app.workers.wait_for_complete()
            _append_step(db, world, steps + i)
            t = time.perf_counter()
            n = app.refresh_count + 1
            app.request_refresh()
            await _wait(pilot, app, n)
            painted.append(time.perf_counter() - t)
            refresh.append(app.last_read_s + app.last_apply_s)
    return first, refresh, painted


def _measure_data(db: str, world: int, step0: int, rounds: int) -> tuple[list[float], float]:
    """overview() after each new step, and the app's "anything new?" poll when nothing is."""
    data = TuiData(db, clock=lambda: T0)  # diagnosis is not in overview(): timed separately
    data.overview()
    out = []
    for i in range(rounds):
        _append_step(db, world, step0 + i)
        t = time.perf_counter()
        data.overview()
        out.append(time.perf_counter() - t)
    data.changed()
    t = time.perf_counter()
    for _ in range(1000):
        data.changed()
    idle = (time.perf_counter() - t) / 1000
    data.close()
    return out, idle


def _measure_analysis(db: str) -> float:
    analyzer = Analyzer(db, clock=lambda: T0)
    t = time.perf_counter()
    analyzer.run()
    dt = time.perf_counter() - t
    analyzer.close()
    return dt


def _measure_history(tmp: str, steps: int, ranks: int, raw_tail: int) -> dict[str, float]:
    """First paint of a long finished run (history tables) vs same-run baselines."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_history", Path(__file__).with_name("history.py"))
    assert spec is not None and spec.loader is not None
    bench_history = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_history)
    db = os.path.join(tmp, "history.db")
    t = time.perf_counter()
    bench_history.build(db, steps, ranks, raw_tail)
    print(
        f"[history] built {steps:,} steps x {ranks} ranks (raw: newest {raw_tail:,}) in {time.perf_counter() - t:.1f} s"
    )
    small = os.path.join(tmp, "small.db")
    build(small, SynthSpec(nnodes=1, ranks_per_node=2, steps=50, with_detail=False))
    now = 1.7e9 + steps * 0.02 + 3600
    # Alternate the two apps so both see the same machine load; medians of 3.
    firsts, smalls = [], []
    for _ in range(3):
        firsts.append(asyncio.run(_first_paint(db, now)))
        smalls.append(asyncio.run(_first_paint(small, now)))
    data_s = []
    for _ in range(3):
        t = time.perf_counter()
        data = TuiData(db, clock=lambda: now)
        ov = data.overview()
        data_s.append(time.perf_counter() - t)
        data.close()
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    t = time.perf_counter()
    raw_rows = con.execute("SELECT count(*) FROM steps").fetchone()[0]
    con.execute(
        "SELECT rank_id, step / 1024, min(step_ns), avg(step_ns), max(step_ns) FROM steps GROUP BY rank_id, step / 1024"
    ).fetchall()
    scan = (time.perf_counter() - t) * steps * ranks / max(1, raw_rows)
    con.close()
    first, small_first, data_med = (statistics.median(x) for x in (firsts, smalls, data_s))
    print(
        f"[history] first paint            {first * 1e3:8.1f} ms median of 3 ({ov.series_label}, "
        f"{len(ov.step_series.values)} points, steps {ov.header.first_step}-{ov.header.latest_step})"
    )
    print(f"[history] baseline: first paint of a 2-rank run {small_first * 1e3:8.1f} ms (same run)")
    print(f"[history] data overview() cold   {data_med * 1e3:8.1f} ms median of 3")
    print(f"[history] baseline: naive full scan extrapolated to {steps * ranks:,} rows: {scan:.1f} s")
    return {
        "history_steps": steps,
        "history_ranks": ranks,
        "history_first_paint_ms": round(first * 1e3, 2),
        "history_small_first_paint_ms": round(small_first * 1e3, 2),
        "history_first_paint_over_small": round(first / small_first, 3),
        "history_data_ms": round(data_med * 1e3, 2),
        "history_naive_scan_extrapolated_s": round(scan, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="2,1024,4096")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--history-steps", type=int, default=200_000)
    ap.add_argument("--history-ranks", type=int, default=64)
    ap.add_argument("--history-raw-tail", type=int, default=2_000)
    ns = ap.parse_args()
    results: dict[str, float | None] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in (int(x) for x in ns.sizes.split(",")):
            db = os.path.join(tmp, f"r{world}.db")
            per_node = min(world, 8)
            spec = SynthSpec(nnodes=world // per_node, ranks_per_node=per_node, steps=ns.steps, finished=False)
            t = time.perf_counter()
            build(db, spec)
            print(f"[{world} ranks] built {world * ns.steps} step rows in {time.perf_counter() - t:.1f} s")
            first, refresh, painted = asyncio.run(_measure_app(db, world, ns.steps, ns.rounds))
            data, idle_poll = _measure_data(db, world, ns.steps + ns.rounds, ns.rounds)
            base = _baseline(db)
            diag = _measure_analysis(db)
            med_r, med_d, med_p = statistics.median(refresh), statistics.median(data), statistics.median(painted)
            print(f"[{world} ranks] first paint        {first * 1e3:8.1f} ms")
            print(f"[{world} ranks] refresh (read+UI)  {med_r * 1e3:8.1f} ms median, {max(refresh) * 1e3:.1f} ms max")
            print(f"[{world} ranks] refresh to painted {med_p * 1e3:8.1f} ms median (includes the pilot's polling)")
            print(f"[{world} ranks] data overview()    {med_d * 1e3:8.1f} ms median")
            print(f"[{world} ranks] poll, nothing new  {idle_poll * 1e6:8.1f} us (data.changed(), 10x a second)")
            print(f"[{world} ranks] baseline window scan {base * 1e3:6.1f} ms (plain sqlite3, same run)")
            print(f"[{world} ranks] refresh / baseline {med_r / base:8.2f}")
            print(
                f"[{world} ranks] analysis (own worker) {diag * 1e3:6.1f} ms (every 5th refresh, off the refresh path)"
            )
            results[f"first_paint_ms_{world}"] = round(first * 1e3, 2)
            results[f"refresh_ms_{world}"] = round(med_r * 1e3, 2)
            results[f"refresh_painted_ms_{world}"] = round(med_p * 1e3, 2)
            results[f"data_ms_{world}"] = round(med_d * 1e3, 2)
            results[f"idle_poll_us_{world}"] = round(idle_poll * 1e6, 2)
            results[f"baseline_scan_ms_{world}"] = round(base * 1e3, 2)
            results[f"refresh_over_baseline_{world}"] = round(med_r / base, 3)
            results[f"analysis_ms_{world}"] = round(diag * 1e3, 2)
        if "refresh_painted_ms_2" in results:
            # Same-run floor of "refresh to painted": the 2-rank run is Textual's frame and the pilot's polling.
            for key in [k for k in results if k.startswith("refresh_painted_ms_") and k != "refresh_painted_ms_2"]:
                size = key.rsplit("_", 1)[1]
                extra = results[key] - results["refresh_painted_ms_2"]  # type: ignore[operator]
                print(f"[{size} ranks] refresh to painted beyond the 2-rank floor {extra:6.1f} ms")
                results[f"refresh_painted_over_floor_ms_{size}"] = round(extra, 2)
        if ns.history_steps > 0:
            results.update(_measure_history(tmp, ns.history_steps, ns.history_ranks, ns.history_raw_tail))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
