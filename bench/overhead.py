"""Training-thread cost of ``agent.trace_step`` + automatic phase capture (CPU).

Four modes run interleaved block by block in one process, so a noisy
machine hits all of them alike: ``none`` (no instrumentation installed),
``tracer`` (an installed Tracer called directly, deep dive off), ``public``
(the user's path: ``agent.init()`` once, then ``with agent.trace_step(model)``;
no daemon or relay listens, as for a job whose daemon is down) and
``profiler`` (torch.profiler, CPU activity). The runtime's tracer is only
installed during ``public`` blocks, so its patches never sit in the other
modes' way; its sender thread runs throughout, for every mode alike. A step is a real forward/backward/SGD step of
a Sequential of N modules with one DataLoader fetch, padded to the target
step time with a FIXED spin: the loop count is calibrated once per
configuration on the uninstrumented step and then reused unchanged by every
mode. (Padding with ``spin_until(t0 + target)`` would let the spin absorb the
tracer's own cost and report zero overhead.)

Figures, each printed beside the baseline it is compared with:

* per configuration: cost per step = median(mode) - median(none) over all
  blocks, with the min/max of the per-round differences, and that cost as a
  percentage of the uninstrumented step;
* the relative cost on the ~20 ms step, both as measured there and as the
  (much less noisy) 0.3 ms-step cost divided by the 20 ms step;
* launch cost: ``python -c 'import agent; agent.init()'`` against
  ``python -c 'import torch'`` (the issue's pair; init() imports no torch),
  ``python -c 'import torch; import agent; agent.init()'`` against the same
  baseline (what a training script pays), and ``agent.init()`` alone, with
  no daemon.

Ends with one JSON line. ``--long`` runs more rounds; ``--quick`` fewer.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import agent
from agent.recorder import Recorder
from agent.tracer import Tracer

MODES_ALL = ("none", "tracer", "public", "profiler")
TraceFn = Callable[[torch.nn.Module], AbstractContextManager[Any]]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _layer(i: int) -> torch.nn.Module:
    # Mostly Identity so that even 512 modules make a step of a few ms (a deep model of
    # real layers would drown a microsecond-scale cost in its own noise); every 8th is a
    # Linear, so parameters, gradients and the optimizer grow with depth as well.
    if i % 8 == 0:
        return torch.nn.Linear(8, 8)
    if i % 8 == 4:
        return torch.nn.Tanh()
    return torch.nn.Identity()


def make_model(n_modules: int) -> torch.nn.Module:
    # n_modules counts every module including the Sequential itself.
    return torch.nn.Sequential(*[_layer(i) for i in range(n_modules - 1)])


class _QuietStderr:
    """torch.profiler's native layer prints start/stop lines on fd 2: keep the report readable."""

    def __enter__(self) -> None:
        sys.stderr.flush()
        self._saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)

    def __exit__(self, *exc: object) -> None:
        os.dup2(self._saved, 2)
        os.close(self._saved)


def spin(iterations: int) -> int:
    """A fixed amount of pure-Python work: its cost does not depend on what ran before."""
    acc = 0
    for i in range(iterations):
        acc ^= i
    return acc


def calibrate_spin() -> float:
    """Spin iterations per nanosecond (median of a few tries, done once)."""
    rates = []
    for _ in range(7):
        n = 200_000
        t0 = time.perf_counter_ns()
        spin(n)
        rates.append(n / max(1, time.perf_counter_ns() - t0))
    return statistics.median(rates)


class Workload:
    """One model + optimizer + endless loader; ``step`` runs one padded step."""

    def __init__(self, n_modules: int) -> None:
        self.model = make_model(n_modules)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.loader = DataLoader(TensorDataset(torch.randn(4096, 8)), batch_size=4)
        self._it: Iterator[Any] = iter(self.loader)
        self.pad = 0

    def _next(self) -> torch.Tensor:
        try:
            (x,) = next(self._it)
        except StopIteration:
            self._it = iter(self.loader)
            (x,) = next(self._it)
        return x

    def _body(self, x: torch.Tensor) -> None:
        self.model(x).sum().backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        spin(self.pad)

    def run(self, steps: int, trace: TraceFn | None) -> list[int]:
        perf = time.perf_counter_ns
        model = self.model
        times: list[int] = []
        for _ in range(steps):
            t0 = perf()
            x = self._next()
            if trace is not None:
                with trace(model):
                    self._body(x)
            else:
                self._body(x)
            times.append(perf() - t0)
        return times


def start_public() -> None:
    """``agent.init()`` as a training script calls it, with no daemon and no relay.

    The ports are unused ones (this run must not talk to a daemon another job
    started) and the in-process relay is off; the sender thread retries in the
    background like it would for a job whose daemon is down. The runtime's
    tracer is then uninstalled until a ``public`` block needs it.
    """
    os.environ["TRACEML_DAEMON"] = f"127.0.0.1:{_free_port()}"
    os.environ["TRACEML_RELAY_PORT"] = str(_free_port())
    os.environ["TRACEML_NO_RELAY"] = "1"
    for var in ("TRACEML_DISABLE", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        os.environ.pop(var, None)
    agent.init()
    _public_tracer().uninstall()


def _public_tracer() -> Any:
    from agent import runtime

    rt = runtime.current
    if rt is None or rt.tracer is None:
        raise RuntimeError("agent.init() did not start a tracer")
    return rt.tracer


def run_block(mode: str, work: Workload, steps: int, recorder: Recorder, warmup: int = 2) -> list[int]:
    """One block of ``steps`` timed steps in ``mode``; set-up and warm-up steps are not timed."""
    tracer: Any = None
    trace: TraceFn | None = None
    prof: Any = None
    if mode == "tracer":
        tracer = Tracer(recorder, event_backend=None)
        tracer.install()
        trace = tracer.trace_step
    elif mode == "public":
        tracer = _public_tracer()
        tracer.install()
        trace = agent.trace_step
    elif mode == "profiler":
        # Its stop processes every recorded op (seconds for deep models): fewer steps keep
        # the run short, and medians over equal-length blocks are not needed to compare.
        steps = min(steps, 40)
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        with _QuietStderr():
            prof.__enter__()
    try:
        # The first traced step describes the model and registers its hooks (once per model).
        work.run(warmup, trace)
        return work.run(steps, trace)
    finally:
        if tracer is not None:
            tracer.uninstall()
            if mode == "tracer":
                tracer.poll()  # rows are built here, on the sender thread in real use: not timed
        if prof is not None:
            with _QuietStderr():
                prof.__exit__(None, None, None)
        recorder.drain()  # the sender thread's job: not on the timed path


def measure_config(n_modules: int, target_ms: float, rate: float, rounds: int, budget_ms: float,
                   modes: list[str], recorder: Recorder) -> dict[str, Any]:
    work = Workload(n_modules)
    # Calibrate the pad once, on the uninstrumented step; every mode reuses the same count.
    work.run(5, None)
    body_ns = statistics.median(work.run(15, None))
    work.pad = max(0, int((target_ms * 1e6 - body_ns) * rate))
    steps = max(6, int(budget_ms / max(target_ms, body_ns / 1e6) / rounds))
    samples: dict[str, list[int]] = {m: [] for m in modes}
    per_round: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            times = run_block(mode, work, steps, recorder)
            samples[mode].extend(times)
            per_round[mode].append(statistics.median(times))
    base = statistics.median(samples["none"])
    row: dict[str, Any] = {
        "n_modules": n_modules,
        "target_step_ms": target_ms,
        "unpadded_step_us": body_ns / 1e3,
        "pad_iterations": work.pad,
        "steps_per_mode": steps * rounds,
        "none_median_us": base / 1e3,
    }
    line = [f"modules={n_modules:4d} step~{target_ms:5.1f}ms  none (baseline) {base / 1e3:9.1f}us"]
    for mode in modes[1:]:
        med = statistics.median(samples[mode])
        deltas = [(m - b) / 1e3 for m, b in zip(per_round[mode], per_round["none"], strict=True)]
        cost = (med - base) / 1e3
        row[f"{mode}_median_us"] = med / 1e3
        row[f"{mode}_cost_us"] = cost
        row[f"{mode}_cost_us_min"] = min(deltas)
        row[f"{mode}_cost_us_max"] = max(deltas)
        row[f"{mode}_pct"] = 100.0 * cost * 1e3 / base
        line.append(f"{mode} {med / 1e3:9.1f}us = {cost:+8.2f}us ({row[f'{mode}_pct']:+.3f}%) "
                    f"[per-round {min(deltas):+.2f} .. {max(deltas):+.2f}]")
    print("  ".join(line), flush=True)
    return row


# ------------------------------------------------------------------ launch cost


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # No daemon: point the agent and its relay at ports nobody listens on, so the
    # run never touches a daemon (or relay) another job on this machine started.
    env["TRACEML_DAEMON"] = f"127.0.0.1:{_free_port()}"
    env["TRACEML_RELAY_PORT"] = str(_free_port())
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TRACEML_DISABLE"):
        env.pop(var, None)
    return env


INIT_CHILD = (
    "import time, json, torch\n"
    "import agent\n"
    "t0 = time.perf_counter_ns(); agent.init(); t1 = time.perf_counter_ns()\n"
    "agent.shutdown(); t2 = time.perf_counter_ns()\n"
    "print(json.dumps({'init_ns': t1 - t0, 'shutdown_ns': t2 - t1}))\n"
)


def _wall(code: str) -> tuple[float, str]:
    t0 = time.perf_counter_ns()
    out = subprocess.run([sys.executable, "-c", code], env=_child_env(), cwd=REPO, capture_output=True, text=True,
                         check=True, timeout=120)
    return (time.perf_counter_ns() - t0) / 1e6, out.stdout


LAUNCH_CODES = {
    "torch": "import torch",
    # The comparison. agent.init() no longer imports torch (the tracer is built on
    # first use, or on the agent's thread when torch is already there), so on its own it is
    # much cheaper than the baseline, which says little about a training script ...
    "agent": "import agent; agent.init()",
    # ... which imports torch anyway: what the agent adds to that launch, exit included.
    "torch_agent": "import torch; import agent; agent.init()",
}


def measure_launch(runs: int) -> dict[str, Any]:
    walls: dict[str, list[float]] = {name: [] for name in LAUNCH_CODES}
    init_ms: list[float] = []
    shutdown_ms: list[float] = []
    names = list(LAUNCH_CODES)
    for i in range(runs):
        # Rotate the order so a background burst does not always hit the same one.
        for name in names[i % len(names):] + names[:i % len(names)]:
            walls[name].append(_wall(LAUNCH_CODES[name])[0])
        _, out = _wall(INIT_CHILD)
        fig = json.loads(out.strip().splitlines()[-1])
        init_ms.append(fig["init_ns"] / 1e6)
        shutdown_ms.append(fig["shutdown_ns"] / 1e6)
    med = {name: statistics.median(ms) for name, ms in walls.items()}
    res = {
        "launch_torch_ms": med["torch"],
        "launch_agent_init_ms": med["agent"],
        "launch_cost_ms": med["agent"] - med["torch"],
        "launch_torch_agent_init_ms": med["torch_agent"],
        "launch_cost_with_torch_ms": med["torch_agent"] - med["torch"],
        "launch_torch_ms_minmax": [min(walls["torch"]), max(walls["torch"])],
        "launch_agent_init_ms_minmax": [min(walls["agent"]), max(walls["agent"])],
        "launch_torch_agent_init_ms_minmax": [min(walls["torch_agent"]), max(walls["torch_agent"])],
        "init_ms": statistics.median(init_ms),
        "init_ms_minmax": [min(init_ms), max(init_ms)],
        "shutdown_no_daemon_ms": statistics.median(shutdown_ms),
        "launch_runs": runs,
    }

    def span(name: str) -> str:
        return f"{med[name]:.0f}ms [{min(walls[name]):.0f}..{max(walls[name]):.0f}]"

    print(f"launch: python -c 'import agent; agent.init()' {span('agent')} vs baseline python -c 'import torch' "
          f"{span('torch')} -> {res['launch_cost_ms']:+.0f}ms (median of {runs}; init() imports no torch)",
          flush=True)
    print(f"launch: python -c 'import torch; import agent; agent.init()' {span('torch_agent')} vs baseline "
          f"python -c 'import torch' {span('torch')} -> {res['launch_cost_with_torch_ms']:+.0f}ms added",
          flush=True)
    print(f"agent.init() with torch already imported, no daemon: {res['init_ms']:.2f}ms "
          f"[{min(init_ms):.2f}..{max(init_ms):.2f}]; agent.shutdown() then {res['shutdown_no_daemon_ms']:.0f}ms",
          flush=True)
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long", action="store_true", help="more rounds and steps (several minutes)")
    ap.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    ap.add_argument("--no-profiler", action="store_true")
    ap.add_argument("--no-public", action="store_true", help="skip the agent.init()/agent.trace_step mode")
    ap.add_argument("--no-launch", action="store_true")
    ap.add_argument("--modules", default="4,64,512", help="model sizes (comma-separated module counts)")
    ap.add_argument("--targets", default="0.3,2,20", help="padded step times in ms (0.3 gives the (a) figures)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rounds = 10 if args.long else (2 if args.quick else 6)
    budget_ms = 6000.0 if args.long else (800.0 if args.quick else 2000.0)  # timed ms per mode per config
    modes = (["none", "tracer"] + ([] if args.no_public else ["public"])
             + ([] if args.no_profiler else ["profiler"]))
    if "public" in modes:
        start_public()
    recorder = Recorder()
    rate = calibrate_spin()
    print(f"spin calibration: {rate * 1e3:.1f} iterations/us; modes {', '.join(modes)} run interleaved, "
          f"{rounds} rounds", flush=True)
    sizes = [int(n) for n in args.modules.split(",")]
    targets = [float(ms) for ms in args.targets.split(",")]
    results = [measure_config(n, ms, rate, rounds, budget_ms, modes, recorder) for n in sizes for ms in targets]

    # (a) training-thread cost: the shortest step is the least noisy place to read it.
    hot_ms = min(targets)
    hot = {str(r["n_modules"]): r for r in results if r["target_step_ms"] == hot_ms}
    figures: dict[str, Any] = {}
    for mode in [m for m in ("tracer", "public") if m in modes]:
        cost_us = {k: r[f"{mode}_cost_us"] for k, r in hot.items()}
        flat = max(cost_us.values()) - min(cost_us.values())
        figures[f"{mode}_cost_us"] = cost_us
        figures[f"{mode}_cost_spread_us"] = flat
        for k, r in hot.items():
            print(f"(a) {mode} cost per step, {k:>3} modules: {r[f'{mode}_cost_us']:+.2f}us "
                  f"[per-round {r[f'{mode}_cost_us_min']:+.2f} .. {r[f'{mode}_cost_us_max']:+.2f}] "
                  f"(baseline step {r['none_median_us']:.1f}us, with {mode} {r[f'{mode}_median_us']:.1f}us)",
                  flush=True)
        print(f"(a) {mode} spread {min(sizes)} -> {max(sizes)} modules: {flat:.2f}us", flush=True)
    # (b) relative to the ~20 ms step.
    rel: dict[str, Any] = {}
    hot_cost = figures["tracer_cost_us"]
    for r in results:
        if r["target_step_ms"] != 20.0:
            continue
        k = str(r["n_modules"])
        rel[k] = {"measured_pct": r["tracer_pct"], "from_hot_pct": 100.0 * hot_cost[k] / r["none_median_us"],
                  "step_us": r["none_median_us"]}
        print(f"(b) relative to the 20 ms step, {k:>3} modules: measured {r['tracer_pct']:+.4f}%, "
              f"{hot_ms} ms-step cost / 20 ms step {rel[k]['from_hot_pct']:+.4f}% "
              f"(baseline step {r['none_median_us'] / 1e3:.3f}ms)", flush=True)
    launch = {} if args.no_launch else measure_launch(3 if not args.long else 7)
    if "public" in modes:
        agent.shutdown()
    print(json.dumps({"configs": results, **figures, "relative_20ms": rel, **launch}))


if __name__ == "__main__":
    main()
