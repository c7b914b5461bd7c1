"""Training-thread cost of FSDP2 collective timing (agent/capture/fsdp2_comm.py), CPU.

A real 2-rank gloo job (torch.multiprocessing) trains the CPU test model of
examples/train.py (``build_model(64, 256, 4)``, every Linear and the root sharded
with ``fully_shard``) under an installed Tracer. Two figures, each beside the
baseline it is taken against, from the same run:

* (a) paired, the figure: inside real traced steps on rank 0, the step's FSDP2
  collectives are replayed against a no-op collective, once through the timing
  proxy and once called directly, interleaved round by round; the difference is
  what the timing adds to a step on the training thread (its exact code path:
  active-step check, phase and dimension, two clock reads, the step's
  accumulator), with the number of collectives a step of the test model really
  issues (counted by the timer). Median of rounds, and the min..max.
* (b) end to end, context: the same job steps in alternating blocks with the
  timing installed and not (the proxy swapped in and out between blocks, both
  ranks at once); median training-thread CPU time and wall time per step of
  each arm. Gloo collectives on a shared 2-core machine move steps by far more
  than the figure, so (b) shows there is no hidden cost, not the cost itself;
  ``--aa`` keeps the timing on in both arms, so its (b) is that noise alone.

Ends with one JSON line. ``--quick`` runs fewer steps.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _paired(tracer: Any, calls: int, rounds: int) -> tuple[list[float], list[float]]:
    """(per-step ns through the proxy, per-step ns direct), one pair per round."""
    from types import SimpleNamespace

    from agent.capture import fsdp2_comm

    real = SimpleNamespace(all_gather_single=_noop, reduce_scatter_single=_noop, all_reduce=_noop)
    proxy = fsdp2_comm.TimedDist(real, fsdp2_comm.Fsdp2Timer(tracer))  # type: ignore[arg-type]
    model = torch.nn.Linear(2, 2)
    # The step's mix: a third all-gathers in forward, the rest in backward (all-gather, reduce-scatter).
    fwd = calls // 3
    timed: list[float] = []
    direct: list[float] = []
    perf = time.perf_counter_ns
    for _ in range(rounds):
        for arm in (0, 1) if len(timed) % 2 == 0 else (1, 0):
            ag = proxy.all_gather_single if arm == 0 else real.all_gather_single
            rs = proxy.reduce_scatter_single if arm == 0 else real.reduce_scatter_single
            reps = 500
            t0 = perf()
            for _ in range(reps):
                with tracer.trace_step(model):
                    rec = tracer._active
                    for _ in range(fwd):
                        ag()
                    rec.bwd_depth = 1  # as the backward wrapper sets it
                    for i in range(calls - fwd):
                        (ag if i % 2 else rs)()
                    rec.bwd_depth = 0
            (timed if arm == 0 else direct).append((perf() - t0) / reps)
        tracer.poll()
        tracer._recorder.drain()
    return timed, direct


def _worker(rank: int, port: int, out: str, steps: int, block: int, rounds: int, aa: bool) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives
    from torch.distributed.fsdp import fully_shard
    from train import build_model

    from agent.capture import fsdp2_comm
    from agent.recorder import Recorder
    from agent.tracer import Tracer

    tracer = Tracer(Recorder(), event_backend=None)
    tracer.install()
    torch.manual_seed(0)
    model = build_model(64, 256, 4)
    for block_ in model:
        if isinstance(block_, torch.nn.Linear):
            fully_shard(block_)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    xs = torch.randn(32, 64, generator=gen)
    ys = torch.randn(32, 1, generator=gen)

    def step() -> tuple[int, int]:
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        with tracer.trace_step(model):
            loss = torch.nn.functional.mse_loss(model(xs), ys)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return time.thread_time_ns() - c0, time.perf_counter_ns() - w0

    for _ in range(10):  # warm-up; installs the proxy (first traced FSDP2 step)
        step()
    proxy = collectives.dist
    assert isinstance(proxy, fsdp2_comm.TimedDist)
    timer = fsdp2_comm.timer()
    assert timer is not None
    calls0 = timer.calls
    arms: dict[str, dict[str, list[int]]] = {"on": {"cpu": [], "wall": []}, "off": {"cpu": [], "wall": []}}
    n_on = 0
    for b in range(steps // block):
        on = b % 2 == 0
        collectives.dist = proxy if on or aa else proxy._real
        for _ in range(block):
            cpu, wall = step()
            arms["on" if on else "off"]["cpu"].append(cpu)
            arms["on" if on else "off"]["wall"].append(wall)
            n_on += on or aa  # the timer counts in both arms of the A/A control
        tracer.poll()
        tracer._recorder.drain()
    collectives.dist = proxy
    calls_per_step = (timer.calls - calls0) / max(1, n_on)
    units = sum(isinstance(m, torch.nn.Linear) for m in model)
    result: dict[str, Any] = {"arms": arms, "calls_per_step": calls_per_step, "units": units}
    if rank == 0:
        result["paired"] = _paired(tracer, round(calls_per_step), rounds)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    tracer.uninstall()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # FSDP2 on gloo may abort in a destructor at teardown (tests/agent/test_capture_ddp.py)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=1200, help="end-to-end steps (blocks alternate on/off)")
    p.add_argument("--block", type=int, default=20)
    p.add_argument("--rounds", type=int, default=40, help="paired rounds of (a)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--aa", action="store_true", help="A/A control for (b): the timing stays on in both arms")
    args = p.parse_args()
    if args.quick:
        args.steps, args.rounds = 200, 10
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(_free_port(), out, args.steps, args.block, args.rounds, args.aa), nprocs=2, join=True)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    timed, direct = ranks[0]["paired"]
    diffs = [(t - d) / 1e3 for t, d in zip(timed, direct, strict=True)]
    calls = ranks[0]["calls_per_step"]
    added_us = statistics.median(diffs)
    print(f"FSDP2 test model (examples/train.py build_model(64, 256, 4): {ranks[0]['units']} Linear units + root), "
          f"2 ranks gloo CPU; {calls:.0f} collectives timed per step")
    print(f"(a) added per step on the training thread: {added_us:.2f} us (median of {len(diffs)} rounds, "
          f"min {min(diffs):.2f} .. max {max(diffs):.2f}); baseline: the same step with direct calls "
          f"{statistics.median(direct) / 1e3:.2f} us; per collective {added_us * 1e3 / max(1.0, calls):.0f} ns")
    figures: dict[str, Any] = {"aa_control": args.aa, "collectives_per_step": calls, "added_us_per_step": round(added_us, 3),
                               "added_us_min": round(min(diffs), 3), "added_us_max": round(max(diffs), 3),
                               "baseline_direct_step_us": round(statistics.median(direct) / 1e3, 3)}
    for rank, res in enumerate(ranks):
        on, off = res["arms"]["on"], res["arms"]["off"]
        cpu_on, cpu_off = statistics.median(on["cpu"]) / 1e3, statistics.median(off["cpu"]) / 1e3
        wall_on, wall_off = statistics.median(on["wall"]) / 1e3, statistics.median(off["wall"]) / 1e3
        print(f"(b) rank {rank}: thread CPU per step {cpu_on:.0f} us with timing vs {cpu_off:.0f} us without "
              f"({cpu_on - cpu_off:+.0f} us); wall {wall_on:.0f} vs {wall_off:.0f} us ({wall_on - wall_off:+.0f} us); "
              f"{len(on['cpu'])} + {len(off['cpu'])} steps")
        figures[f"rank{rank}_cpu_us_on"] = round(cpu_on, 1)
        figures[f"rank{rank}_cpu_us_off"] = round(cpu_off, 1)
        figures[f"rank{rank}_wall_us_on"] = round(wall_on, 1)
        figures[f"rank{rank}_wall_us_off"] = round(wall_off, 1)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
