"""Training-thread cost of ``Tracer.trace_step`` + automatic phase capture (CPU).

Modes run interleaved round by round in one process, so a noisy machine hits
all of them alike: ``none`` (no instrumentation), ``tracer`` (installed Tracer,
deep dive off) and ``profiler`` (torch.profiler, CPU activity). Each step is a
real forward/backward/SGD step of a Sequential of N modules, padded with a
spin to the target step cost; every step also fetches from a DataLoader.

Cost per step = median(mode) - median(none). Prints medians with min/max per
config and ends with one JSON line. ``--long`` runs more rounds and steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from agent.recorder import Recorder
from agent.tracer import Tracer


def make_model(n_modules: int) -> torch.nn.Module:
    # n_modules counts every module including the Sequential itself.
    layers = [torch.nn.Linear(8, 8) if i % 2 == 0 else torch.nn.Tanh() for i in range(n_modules - 1)]
    return torch.nn.Sequential(*layers)


def spin_until(deadline: int) -> None:
    while time.perf_counter_ns() < deadline:
        pass


def run_mode(mode: str, model: torch.nn.Module, loader: DataLoader[Any], target_ns: int, steps: int,
             tracer: Tracer) -> list[int]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    times: list[int] = []
    perf = time.perf_counter_ns

    def body(x: torch.Tensor, t0: int) -> None:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        spin_until(t0 + target_ns)

    it = iter(loader)
    prof = None
    if mode == "profiler":
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        prof.__enter__()
    try:
        for _ in range(steps):
            t0 = perf()
            try:
                (x,) = next(it)
            except StopIteration:
                it = iter(loader)
                (x,) = next(it)
            if mode == "tracer":
                with tracer.trace_step(model):
                    body(x, t0)
            else:
                body(x, t0)
            times.append(perf() - t0)
    finally:
        if prof is not None:
            prof.__exit__(None, None, None)
    return times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long", action="store_true", help="more rounds and steps (several minutes)")
    ap.add_argument("--no-profiler", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rounds = 6 if args.long else 3
    step_costs_ms = (0.3, 2.0, 20.0)
    module_counts = (4, 64, 512)
    modes = ["none", "tracer"] + ([] if args.no_profiler else ["profiler"])
    recorder = Recorder()
    tracer = Tracer(recorder, event_backend=None)
    tracer.install()
    loader = DataLoader(TensorDataset(torch.randn(4096, 8)), batch_size=4)
    drain: Callable[[], Any] = recorder.drain
    results: list[dict[str, Any]] = []
    for n_modules in module_counts:
        model = make_model(n_modules)
        for cost_ms in step_costs_ms:
            steps = max(5, int((4000 if args.long else 600) / max(cost_ms, 1.0) / 3))
            samples: dict[str, list[int]] = {m: [] for m in modes}
            per_round: dict[str, list[float]] = {m: [] for m in modes}
            run_mode("none", model, loader, int(cost_ms * 1e6), 5, tracer)  # warm up
            for r in range(rounds):
                order = modes if r % 2 == 0 else list(reversed(modes))
                for mode in order:
                    times = run_mode(mode, model, loader, int(cost_ms * 1e6), steps, tracer)
                    samples[mode].extend(times)
                    per_round[mode].append(statistics.median(times))
                    drain()
            base = statistics.median(samples["none"])
            row: dict[str, Any] = {"n_modules": n_modules, "target_step_ms": cost_ms, "steps_per_mode": steps * rounds,
                                   "none_median_us": base / 1e3}
            line = [f"modules={n_modules:4d} step~{cost_ms:5.1f}ms  none={base / 1e3:9.1f}us"]
            for mode in modes[1:]:
                med = statistics.median(samples[mode])
                deltas = [m - b for m, b in zip(per_round[mode], per_round["none"], strict=True)]
                cost_us = (med - base) / 1e3
                row[f"{mode}_cost_us"] = cost_us
                row[f"{mode}_cost_us_min"] = min(deltas) / 1e3
                row[f"{mode}_cost_us_max"] = max(deltas) / 1e3
                row[f"{mode}_pct"] = 100.0 * (med - base) / base
                line.append(f"{mode}: +{cost_us:8.1f}us ({row[f'{mode}_pct']:+.3f}%) "
                            f"[round min {min(deltas) / 1e3:+.1f} max {max(deltas) / 1e3:+.1f}]")
            print("  ".join(line), flush=True)
            results.append(row)
    # Pure hot-path cost: the same steps with no padding, tiny body, many steps.
    hot: dict[str, float] = {}
    for n_modules in module_counts:
        model = make_model(n_modules)
        none_t: list[int] = []
        tr_t: list[int] = []
        for _ in range(rounds * 2):
            none_t.extend(run_mode("none", model, loader, 0, 200, tracer))
            tr_t.extend(run_mode("tracer", model, loader, 0, 200, tracer))
            drain()
        hot[str(n_modules)] = (statistics.median(tr_t) - statistics.median(none_t)) / 1e3
        print(f"hot path, modules={n_modules:4d}: tracer +{hot[str(n_modules)]:.2f}us/step "
              f"(baseline step {statistics.median(none_t) / 1e3:.1f}us)", flush=True)
    tracer.uninstall()
    print(json.dumps({"configs": results, "hot_path_cost_us": hot}))


if __name__ == "__main__":
    main()
