"""Step time with the daemon reachable vs unreachable for the whole run.

Runs a CPU training loop in fresh processes, alternating reachable and
unreachable runs (interleaved, so machine noise hits both alike), and reports
the median step time of each and their ratio. Then runs 100,000 small steps
with the daemon unreachable and reports the agent's extra resident memory
(RSS after the run minus RSS after warm-up) against the same loop with
TRACEML_DISABLE=1.

    python bench/unreachable.py [--rounds 7] [--steps 10000] [--memory-steps 100000]

Ends with one JSON line holding every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(steps: int, width: int, measure_memory: bool) -> None:
    import psutil
    import torch
    from torch import nn

    import agent

    torch.set_num_threads(1)
    agent.init()
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, width), torch.randn(64, 1)
    proc = psutil.Process()
    durations: list[int] = []
    warm = min(1000, steps // 10)
    rss_warm = rss_mid = 0
    for i in range(steps):
        t0 = time.perf_counter_ns()
        with agent.trace_step(model):
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        durations.append(time.perf_counter_ns() - t0)
        if i == warm:
            rss_warm = proc.memory_info().rss
        elif i == steps // 2:
            rss_mid = proc.memory_info().rss
    rss_end = proc.memory_info().rss
    out = {"median_ns": statistics.median(durations[warm:])}
    if measure_memory:
        out.update(rss_warm=rss_warm, rss_mid=rss_mid, rss_end=rss_end)
    print(json.dumps(out), flush=True)
    agent.shutdown()


def _run(env: dict[str, str], steps: int, width: int, memory: bool = False) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--worker", "--steps", str(steps), "--width", str(width)]
    if memory:
        cmd.append("--measure-memory")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"worker failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--width", type=int, default=256, help="MLP width (sets the step cost)")
    p.add_argument("--memory-steps", type=int, default=100_000)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--measure-memory", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.steps, args.width, args.measure_memory)
        return

    base = {k: v for k, v in os.environ.items() if not k.startswith("TRACEML_")}
    base.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    tmp = Path(tempfile.mkdtemp(prefix="traceml-bench-"))
    daemon_port = _free_port()
    daemon = subprocess.Popen([sys.executable, "-m", "traceml_daemon", "serve", "--port", str(daemon_port),
                               "--db", str(tmp / "bench.db")], env=base, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    time.sleep(2.0)
    reachable = dict(base, TRACEML_DAEMON=f"127.0.0.1:{daemon_port}", TRACEML_RELAY_PORT=str(_free_port()))
    dead = _free_port()
    unreachable = dict(base, TRACEML_DAEMON=f"127.0.0.1:{dead}", TRACEML_RELAY_PORT=str(_free_port()),
                       TRACEML_SPOOL_DIR=str(tmp / "spool"))
    try:
        up, down = [], []
        for r in range(args.rounds):
            order = [(up, reachable), (down, unreachable)]
            if r % 2:
                order.reverse()
            for sink, env in order:
                sink.append(_run(env, args.steps, args.width)["median_ns"])
        up_ms = statistics.median(up) / 1e6
        down_ms = statistics.median(down) / 1e6
        print(f"step time, daemon reachable   (baseline): median {up_ms:.3f} ms over {args.rounds} runs "
              f"(min {min(up) / 1e6:.3f}, max {max(up) / 1e6:.3f})")
        print(f"step time, daemon unreachable           : median {down_ms:.3f} ms over {args.rounds} runs "
              f"(min {min(down) / 1e6:.3f}, max {max(down) / 1e6:.3f})")
        print(f"unreachable / reachable = {down_ms / up_ms:.4f}")

        mem = _run(unreachable, args.memory_steps, 16, memory=True)
        off = _run(dict(unreachable, TRACEML_DISABLE="1"), args.memory_steps, 16, memory=True)
        grow = (mem["rss_end"] - mem["rss_warm"]) / 2**20
        grow_off = (off["rss_end"] - off["rss_warm"]) / 2**20
        # Flat means: once the in-memory buffers are full, the second half adds nothing.
        grow_2nd = (mem["rss_end"] - mem["rss_mid"]) / 2**20
        grow_2nd_off = (off["rss_end"] - off["rss_mid"]) / 2**20
        print(f"RSS growth over {args.memory_steps} steps unreachable: {grow:.1f} MiB "
              f"(baseline with TRACEML_DISABLE=1: {grow_off:.1f} MiB); "
              f"extra RSS vs disabled at the end: {(mem['rss_end'] - off['rss_end']) / 2**20:.1f} MiB")
        print(f"RSS growth over the second half ({args.memory_steps // 2} steps): {grow_2nd:.1f} MiB "
              f"(baseline with TRACEML_DISABLE=1: {grow_2nd_off:.1f} MiB)")
        print(json.dumps({
            "reachable_step_ms": up_ms, "unreachable_step_ms": down_ms, "ratio": down_ms / up_ms,
            "memory_steps": args.memory_steps, "rss_growth_mib": grow, "rss_growth_disabled_mib": grow_off,
            "extra_rss_mib": (mem["rss_end"] - off["rss_end"]) / 2**20,
            "rss_growth_second_half_mib": grow_2nd, "rss_growth_second_half_disabled_mib": grow_2nd_off,
        }))
    finally:
        daemon.terminate()
        daemon.wait(30)


if __name__ == "__main__":
    main()
