"""A DDP job for profile-on-demand tests and bench/profile_on_demand.py (torchrun, gloo, CPU).

One ``nn.Linear`` (one ``aten::linear`` per forward, so a trace's step count can be
read from it), steps traced by ``agent.trace_step`` and paced by a sleep inside the
step. Runs ``--steps`` steps, or until ``--stop-file`` exists (checked every tenth step, by all ranks together).
``--times PATH`` writes each step's wall time in seconds, as measured around the
traced step, to ``PATH.<rank>`` (JSON list, step order).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn

import agent


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-s", type=float, default=0.02, help="sleep inside each step")
    p.add_argument("--stop-file", default=None)
    p.add_argument("--times", default=None)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    agent.init()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(32, 32))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 32), torch.randn(16, 32)
    times: list[float] = []
    for step in range(args.steps):
        if args.stop_file and step % 10 == 0:
            # Every rank stops at the same step (one alone would leave the others in an all-reduce).
            flag = torch.tensor([float(os.path.exists(args.stop_file))])
            dist.all_reduce(flag)
            if flag.item() > 0:
                break
        t0 = time.perf_counter()
        with agent.trace_step(model):
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(args.step_s)
        times.append(time.perf_counter() - t0)
    if args.times:
        with open(f"{args.times}.{rank}", "w") as f:
            json.dump(times, f)
    agent.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
