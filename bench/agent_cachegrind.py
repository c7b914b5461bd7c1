"""The agent's per-step work counted under cachegrind: instructions and cache misses.

``bench/overhead.py`` times the training thread's cost; at ~10 us a step its
intervals are a few microseconds wide and runs differ by as much. This counts
instead: each mode runs ``bench/overhead.py``'s workload (a real CPU
forward/backward/SGD step with a DataLoader fetch) under ``valgrind
--tool=cachegrind`` twice, for ``WARMUP`` steps and for ``WARMUP + --steps``
steps, and divides the difference by ``--steps``. Start-up (importing torch)
cancels. Printed per step and mode, beside ``none`` (no instrumentation) in the
same run: instructions, L1 instruction-cache misses, L1 data-cache misses and
last-level misses (cachegrind's simulated caches, this machine's sizes), and
KCachegrind's cycle estimate, which weighs them in one figure
(``cycles_estimate``). ``--modules 4,64,512`` counts each size and ends with
each mode's extra at every size side by side: "flat in model depth" checked by
counting, where bench/overhead.py's timings at 512 modules (a ~3 ms step of
Python and torch) vary by a hundred microseconds from round to round.

A step runs with cold caches (torch's kernels evict the hooks' code and data
between one hook and the next), so the misses, not the instruction count, are
most of what the agent costs: ~900 extra L1i misses against ~30,000 extra
instructions a step when this was written. ``--by-function`` lists the C
functions whose counts differ most from ``none``, the way the backward
wrapper's ``*args, **kwargs`` cost was found (agent/capture/autograd.py).

Counts barely move between runs of one build: PYTHONHASHSEED=0, one thread for
torch and BLAS, and the garbage collector off for the counted steps (one full
collection landing in one mode's window would add ~10,000 instructions a step
to it). Modes: ``none``, ``none_aa`` (the same bare step in runs of its own: the
A/A control, its true difference zero, so its figure is the counting's own noise;
at 512 modules, a step of ~21 million instructions, it was 20 instructions and 47
L1d misses a step), ``null`` (bench/overhead.py's empty mechanisms, the
forward timed by a call wrapper as the tracer does; ``null_hooks``: by the former
forward hooks; until 2026-11-27 ``null`` was that),
``tracer`` (this checkout's Tracer) and ``ref`` (``--reference MODULE``, another
build's Tracer, e.g. a renamed copy of an older agent package on PYTHONPATH).
Needs valgrind; each run takes a minute or two (torch's import, simulated),
and modes run ``--jobs`` at a time.

    python bench/agent_cachegrind.py
    python bench/agent_cachegrind.py --modes none,null,tracer --modules 4,64,512 --steps 200
    python bench/agent_cachegrind.py --modes none,ref,tracer --reference agent_ref.tracer --by-function
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
WARMUP = 50
EVENTS = ("Ir", "I1mr", "D1mr", "D1mw", "ILmr", "DLmr", "DLmw")

# The child: build the workload, run WARMUP steps, then the counted ones with GC off.
CHILD = r"""
import gc, os, sys
sys.path[:0] = [os.environ["REPO"], os.path.join(os.environ["REPO"], "bench")]
import torch
import overhead
from agent.recorder import Recorder
torch.set_num_threads(1)
mode, steps, modules = os.environ["MODE"], int(os.environ["STEPS"]), int(os.environ["MODULES"])
work = overhead.Workload(modules)
trace = None
if mode in ("tracer", "ref"):
    if mode == "ref":
        import importlib
        Tracer = importlib.import_module(os.environ["REFERENCE"]).Tracer
    else:
        from agent.tracer import Tracer
    tracer = Tracer(Recorder(), event_backend=None)
    tracer.install()
    trace = tracer.trace_step
elif mode in ("null", "null_hooks"):
    null = overhead.NullInstrumentation(forward_wrapper=mode == "null")
    null.install(work.model)
    trace = null.trace_step
work.run(int(os.environ["WARMUP"]), trace)
gc.collect()
gc.disable()
work.run(steps, trace)
"""


def load(path: Path) -> dict[str, dict[str, int]]:
    """Per function: the summed counts of a cachegrind output file."""
    events: list[str] = []
    out: dict[str, dict[str, int]] = collections.defaultdict(lambda: collections.defaultdict(int))
    fn = ""
    with path.open() as f:
        for line in f:
            if line.startswith("events:"):
                events = line.split()[1:]
            elif line.startswith("fn="):
                fn = line[3:].strip().split("'")[0]  # recursion depth suffixes merged
            elif line[:1].isdigit() and fn:
                for name, value in zip(events, line.split()[1:], strict=False):
                    out[fn][name] += int(value)
    return out


def run_one(mode: str, steps: int, modules: int, args: argparse.Namespace, tmp: Path) -> dict[str, dict[str, int]]:
    out = tmp / f"cg.{mode}.{modules}.{steps}"
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MKL_NUM_THREADS="1", REPO=str(REPO), MODE=mode, STEPS=str(steps), MODULES=str(modules),
               WARMUP=str(WARMUP), REFERENCE=args.reference)
    cmd = ["valgrind", "--tool=cachegrind", "--cache-sim=yes", f"--cachegrind-out-file={out}",
           sys.executable, "-c", CHILD]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"cachegrind run {mode}/{modules} modules/{steps} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return load(out)


def per_step(short: dict[str, dict[str, int]], long: dict[str, dict[str, int]], steps: int
             ) -> dict[str, dict[str, float]]:
    return {fn: {e: (long[fn].get(e, 0) - short.get(fn, {}).get(e, 0)) / steps for e in EVENTS} for fn in long}


def cycles_estimate(counts: dict[str, float]) -> float:
    """KCachegrind's cycle estimation: an instruction 1, an L1 miss 10, an LL miss 100 (a
    model, not this machine's timings; it weighs misses against instructions in one figure)."""
    l1 = counts["I1mr"] + counts["D1mr"] + counts["D1mw"]
    ll = counts["ILmr"] + counts["DLmr"] + counts["DLmw"]
    return counts["Ir"] + 10 * l1 + 100 * ll


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="none,tracer", help="comma-separated, from none, none_aa, null, null_hooks, tracer, ref")
    ap.add_argument("--steps", type=int, default=500, help="counted steps (the difference of the two runs)")
    ap.add_argument("--modules", default="4",
                    help="model sizes (bench/overhead.py's make_model), comma-separated: 4,64,512 adds the "
                         "depth summary, each mode's extra counts at every size side by side")
    ap.add_argument("--reference", default="", help="module holding another build's Tracer (mode ref)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="valgrind runs at a time")
    ap.add_argument("--by-function", action="store_true",
                    help="list the functions that differ most from none (L1i misses, L1d misses, instructions)")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if "none" not in modes:
        modes.insert(0, "none")
    if "ref" in modes and not args.reference:
        ap.error("mode ref needs --reference MODULE (a module with a Tracer class, importable)")
    try:
        sizes = [int(m) for m in args.modules.split(",") if m.strip()]
    except ValueError:
        ap.error(f"--modules takes whole numbers separated by commas (e.g. 4,64,512), not {args.modules!r}")
    if not sizes or min(sizes) < 1:
        ap.error(f"--modules needs at least one size of 1 or more, not {args.modules!r}")
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed: this bench runs the workload under valgrind --tool=cachegrind")
    print(f"{args.steps} counted steps after {WARMUP}, {', '.join(map(str, sizes))} modules; modes "
          f"{', '.join(modes)}; {2 * len(modes) * len(sizes)} valgrind runs, {args.jobs} at a time", flush=True)
    results: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as d, ThreadPoolExecutor(args.jobs) as pool:
        # Every run queued at once (the pool keeps --jobs busy across sizes), read size by size.
        futures = {(n, m, k): pool.submit(run_one, m, k, n, args, Path(d)) for n in sizes for m in modes
                   for k in (WARMUP, WARMUP + args.steps)}
        for n in sizes:
            counts = {m: per_step(futures[(n, m, WARMUP)].result(), futures[(n, m, WARMUP + args.steps)].result(),
                                  args.steps) for m in modes}
            results[n] = report_size(n, modes, counts, args.by_function)
    if len(sizes) > 1:
        print("by model size, each mode's extra per step against none at that size (same build, same steps):")
        for m in modes[1:]:
            cells = []
            for e in (*EVENTS, "cycles_est"):
                cells.append(f"{e} " + " / ".join(f"{results[n]['vs_none'][m][e]:+,.0f}" for n in sizes))
            print(f"  {m:7s} at {' / '.join(map(str, sizes))} modules: " + "; ".join(cells))
    print(json.dumps({"steps": args.steps, "modules": sizes, "by_modules": {str(n): results[n] for n in sizes}}))


def top_functions(diff: dict[str, dict[str, float]], events: tuple[str, ...], n: int, either_way: bool = False
                  ) -> list[str]:
    """The ``n`` functions whose summed ``events`` differ most: the most extra first, or with
    ``either_way`` the largest differences whatever their sign."""
    def extra(fn: str) -> float:
        total = sum(diff[fn][e] for e in events)
        return abs(total) if either_way else total

    return sorted(diff, key=extra, reverse=True)[:n]


def report_size(modules: int, modes: list[str], counts: dict[str, dict[str, dict[str, float]]],
                by_function: bool) -> dict[str, Any]:
    """Print one model size's per-step counts; return them and their differences from none."""
    totals = {m: {e: sum(f[e] for f in counts[m].values()) for e in EVENTS} for m in modes}
    for t in totals.values():
        t["cycles_est"] = cycles_estimate(t)
    base = totals["none"]
    print(f"{modules} modules, per step: instructions (Ir), L1 instruction misses (I1mr), L1 data read/write "
          "misses (D1mr, D1mw), last-level misses (ILmr, DLmr, DLmw), estimated cycles (cycles_est)")
    for m in modes:
        t = totals[m]
        extra = "" if m == "none" else "\n          vs none: " + ", ".join(f"{e} {t[e] - base[e]:+,.0f}" for e in t)
        print(f"  {m:7s} " + ", ".join(f"{e} {t[e]:,.0f}" for e in t) + extra)
    if by_function:
        for m in modes:
            if m == "none":
                continue
            diff = {fn: {e: counts[m].get(fn, {}).get(e, 0) - counts["none"].get(fn, {}).get(e, 0) for e in EVENTS}
                    for fn in set(counts[m]) | set(counts["none"])}
            for what, events, either_way in (("L1i misses", ("I1mr",), False),
                                             ("L1d misses", ("D1mr", "D1mw"), False),
                                             ("instructions (either way)", ("Ir",), True)):
                print(f"  {m} minus none, the 15 functions with the most extra {what} a step:")
                for fn in top_functions(diff, events, 15, either_way):
                    c = diff[fn]
                    print(f"    I1mr {c['I1mr']:+7.0f}  Ir {c['Ir']:+8.0f}  D1mr {c['D1mr']:+6.0f}  "
                          f"D1mw {c['D1mw']:+6.0f}  {fn[:80]}")
    return {"per_step": totals,
            "vs_none": {m: {e: totals[m][e] - base[e] for e in base} for m in modes if m != "none"}}


if __name__ == "__main__":
    main()
