"""The agent's per-step work counted under cachegrind: instructions and cache misses.

``bench/overhead.py`` times the training thread's cost; at ~10 us a step its
intervals are a few microseconds wide and runs differ by as much. This counts
instead: each mode runs ``bench/overhead.py``'s workload (a real CPU
forward/backward/SGD step with a DataLoader fetch) under ``valgrind
--tool=cachegrind`` twice, for ``WARMUP`` steps and for ``WARMUP + --steps``
steps, and divides the difference by ``--steps``. Start-up (importing torch)
cancels. Printed per step and mode, beside ``none`` (no instrumentation) in the
same run: instructions, L1 instruction-cache misses and L1 data-cache misses
(cachegrind's simulated caches, this machine's sizes).

A step runs with cold caches (torch's kernels evict the hooks' code and data
between one hook and the next), so the misses, not the instruction count, are
most of what the agent costs: ~900 extra L1i misses against ~30,000 extra
instructions a step when this was written. ``--by-function`` lists the C
functions whose counts differ most from ``none``, the way the backward
wrapper's ``*args, **kwargs`` cost was found (agent/capture/autograd.py).

Counts are deterministic given the build: PYTHONHASHSEED=0, one thread for
torch and BLAS, and the garbage collector off for the counted steps (one full
collection landing in one mode's window would add ~10,000 instructions a step
to it). Modes: ``none``, ``null`` (bench/overhead.py's empty mechanisms, the
forward timed by a call wrapper as the tracer does; ``null_hooks``: by the former
forward hooks; until 2026-11-27 ``null`` was that),
``tracer`` (this checkout's Tracer) and ``ref`` (``--reference MODULE``, another
build's Tracer, e.g. a renamed copy of an older agent package on PYTHONPATH).
Needs valgrind; each run takes a minute or two (torch's import, simulated),
and modes run ``--jobs`` at a time.

    python bench/agent_cachegrind.py
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

REPO = Path(__file__).resolve().parents[1]
WARMUP = 50
EVENTS = ("Ir", "I1mr", "D1mr", "D1mw")

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


def run_one(mode: str, steps: int, args: argparse.Namespace, tmp: Path) -> dict[str, dict[str, int]]:
    out = tmp / f"cg.{mode}.{steps}"
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MKL_NUM_THREADS="1", REPO=str(REPO), MODE=mode, STEPS=str(steps), MODULES=str(args.modules),
               WARMUP=str(WARMUP), REFERENCE=args.reference)
    cmd = ["valgrind", "--tool=cachegrind", "--cache-sim=yes", f"--cachegrind-out-file={out}",
           sys.executable, "-c", CHILD]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"cachegrind run {mode}/{steps} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return load(out)


def per_step(short: dict[str, dict[str, int]], long: dict[str, dict[str, int]], steps: int
             ) -> dict[str, dict[str, float]]:
    return {fn: {e: (long[fn].get(e, 0) - short.get(fn, {}).get(e, 0)) / steps for e in EVENTS} for fn in long}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="none,tracer", help="comma-separated, from none, null, null_hooks, tracer, ref")
    ap.add_argument("--steps", type=int, default=500, help="counted steps (the difference of the two runs)")
    ap.add_argument("--modules", type=int, default=4, help="model size (bench/overhead.py's make_model)")
    ap.add_argument("--reference", default="", help="module holding another build's Tracer (mode ref)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="valgrind runs at a time")
    ap.add_argument("--by-function", action="store_true", help="list the functions that differ most from none")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if "none" not in modes:
        modes.insert(0, "none")
    if "ref" in modes and not args.reference:
        ap.error("mode ref needs --reference MODULE (a module with a Tracer class, importable)")
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed: this bench runs the workload under valgrind --tool=cachegrind")
    print(f"{args.steps} counted steps after {WARMUP}, {args.modules} modules; modes {', '.join(modes)}; "
          f"{2 * len(modes)} valgrind runs, {args.jobs} at a time", flush=True)
    with tempfile.TemporaryDirectory() as d, ThreadPoolExecutor(args.jobs) as pool:
        tmp = Path(d)
        futures = {(m, n): pool.submit(run_one, m, n, args, tmp) for m in modes for n in (WARMUP, WARMUP + args.steps)}
        counts = {m: per_step(futures[(m, WARMUP)].result(), futures[(m, WARMUP + args.steps)].result(), args.steps)
                  for m in modes}
    totals = {m: {e: sum(f[e] for f in counts[m].values()) for e in EVENTS} for m in modes}
    base = totals["none"]
    print("per step: instructions (Ir), L1 instruction misses (I1mr), L1 data read/write misses (D1mr, D1mw)")
    for m in modes:
        t = totals[m]
        extra = "" if m == "none" else "   vs none: " + ", ".join(f"{e} {t[e] - base[e]:+,.0f}" for e in EVENTS)
        print(f"  {m:7s} " + ", ".join(f"{e} {t[e]:,.0f}" for e in EVENTS) + extra)
    if args.by_function:
        for m in modes:
            if m == "none":
                continue
            diff = {fn: {e: counts[m].get(fn, {}).get(e, 0) - counts["none"].get(fn, {}).get(e, 0) for e in EVENTS}
                    for fn in set(counts[m]) | set(counts["none"])}
            print(f"  {m} minus none, the 15 functions with the most extra L1i misses a step:")
            for fn in sorted(diff, key=lambda f: -diff[f]["I1mr"])[:15]:
                c = diff[fn]
                print(f"    I1mr {c['I1mr']:+7.0f}  Ir {c['Ir']:+8.0f}  D1mr {c['D1mr']:+6.0f}  {fn[:90]}")
    print(json.dumps({"steps": args.steps, "modules": args.modules, "per_step": totals,
                      "vs_none": {m: {e: totals[m][e] - base[e] for e in EVENTS} for m in modes if m != "none"}}))


if __name__ == "__main__":
    main()
