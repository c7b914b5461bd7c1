"""TUI benchmark: time to first paint and per-refresh cost at 2, 1024 and 4096 ranks.

For each size a synthetic live run (a few hundred steps per rank) is written
with the real schema. Measured:

* first paint: from constructing the app to the first completed refresh
  painted (``run_test`` at 200x50);
* refresh: one new step for every rank is written (untimed), then the time
  for the worker's read plus the widget update (the app's own counters);
  median over the rounds; also the time until painted, seen from the pilot;
* data: the data module's ``overview()`` alone on the same new rows;
* baseline: a plain sqlite3 read of the same recent window without the
  incremental cursors (``WHERE step > latest - 32``, a scan), in the same run.

Target (docs/DESIGN): refresh at 1024 ranks <= 50 ms. Ends with one JSON line.

    .venv/bin/python bench/tui.py [--sizes 2,1024,4096] [--steps 300] [--rounds 15]
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

from traceml_daemon.tui.app import TraceApp  # noqa: E402
from traceml_daemon.tui.data import TuiData  # noqa: E402
from traceml_daemon.tui.synth import T0, SynthSpec, build, step_row  # noqa: E402

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


async def _measure_app(db: str, world: int, steps: int, rounds: int) -> tuple[float, list[float], list[float]]:
    now = T0 + steps * 0.05
    t0 = time.perf_counter()
    app = TraceApp(db, clock=lambda: now, refresh_s=0)
    refresh: list[float] = []
    painted: list[float] = []
    async with app.run_test(size=(200, 50)) as pilot:
        await _wait(pilot, app, 1)
        first = time.perf_counter() - t0
        for i in range(rounds):
            _append_step(db, world, steps + i)
            t = time.perf_counter()
            n = app.refresh_count + 1
            app.request_refresh()
            await _wait(pilot, app, n)
            painted.append(time.perf_counter() - t)
            refresh.append(app.last_read_s + app.last_apply_s)
    return first, refresh, painted


def _measure_data(db: str, world: int, step0: int, rounds: int) -> list[float]:
    data = TuiData(db, clock=lambda: T0, diagnose_every=rounds + 1)  # diagnosis timed separately
    data.overview()
    out = []
    for i in range(rounds):
        _append_step(db, world, step0 + i)
        t = time.perf_counter()
        data.overview()
        out.append(time.perf_counter() - t)
    data.close()
    return out


def _measure_diagnose(db: str) -> float | None:
    try:
        from traceml_daemon.analysis.engine import diagnose
    except ImportError:
        return None
    data = TuiData(db, clock=lambda: T0)
    data.overview()
    run = data.run_data()
    t = time.perf_counter()
    diagnose(run)
    dt = time.perf_counter() - t
    data.close()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="2,1024,4096")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=15)
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
            data = _measure_data(db, world, ns.steps + ns.rounds, ns.rounds)
            base = _baseline(db)
            diag = _measure_diagnose(db)
            med_r, med_d, med_p = statistics.median(refresh), statistics.median(data), statistics.median(painted)
            print(f"[{world} ranks] first paint        {first * 1e3:8.1f} ms")
            print(f"[{world} ranks] refresh (read+UI)  {med_r * 1e3:8.1f} ms median, {max(refresh) * 1e3:.1f} ms max")
            print(f"[{world} ranks] refresh to painted {med_p * 1e3:8.1f} ms median (includes the pilot's polling)")
            print(f"[{world} ranks] data overview()    {med_d * 1e3:8.1f} ms median")
            print(f"[{world} ranks] baseline window scan {base * 1e3:6.1f} ms (plain sqlite3, same run)")
            print(f"[{world} ranks] refresh / baseline {med_r / base:8.2f}")
            if diag is not None:
                print(f"[{world} ranks] diagnose() window  {diag * 1e3:8.1f} ms (every 5th refresh)")
            results[f"first_paint_ms_{world}"] = round(first * 1e3, 2)
            results[f"refresh_ms_{world}"] = round(med_r * 1e3, 2)
            results[f"refresh_painted_ms_{world}"] = round(med_p * 1e3, 2)
            results[f"data_ms_{world}"] = round(med_d * 1e3, 2)
            results[f"baseline_scan_ms_{world}"] = round(base * 1e3, 2)
            results[f"refresh_over_baseline_{world}"] = round(med_r / base, 3)
            results[f"diagnose_ms_{world}"] = None if diag is None else round(diag * 1e3, 2)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
