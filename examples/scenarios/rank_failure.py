"""Rank failure: every rank prints a progress line each step, rank 2 also a warning,
and rank 2 raises at step --fail-at. The daemon stores every rank's output;
``traceml-daemon logs`` folds it across ranks and the summary names rank 2 with
its traceback.

    torchrun --nproc-per-node 4 examples/scenarios/rank_failure.py --fail-at 20
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import agent


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fail-at", type=int, default=20)
    p.add_argument("--failing-rank", type=int, default=2)
    # Before the failure every rank waits this long, so their lines are flushed first.
    p.add_argument("--settle-s", type=float, default=1.5)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    agent.init()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _step in range(args.fail_at + 1):
        x, y = torch.randn(8, 16), torch.randn(8, 1)
        with agent.trace_step(model):
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        print("training: epoch 0 in progress", flush=True)
        if rank == args.failing_rank:
            print("warning: gradient norm is large on this rank", file=sys.stderr, flush=True)
    dist.barrier()
    time.sleep(args.settle_s)
    if rank == args.failing_rank:
        raise RuntimeError(f"rank {rank} lost its data shard at step {args.fail_at}")
    dist.barrier()  # the others wait here until torchrun stops them


if __name__ == "__main__":
    main()
