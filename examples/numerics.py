"""A small deterministic training job with numerics fingerprints on, and faults to inject.

Runs under ``torchrun`` (DDP, gloo on the CPU) or plain ``python``. Every flag
below injects one fault at one step, so the tests (and a curious user) can see
what the daemon names: a replica drifting by one ULP (REPLICA_DIVERGED), a
gradient gone NaN (GRAD_NONFINITE), or one layer's learning rate changed (two
runs that ``traceml-daemon compare`` finds parting at that step and layer).

    torchrun --nproc-per-node 3 examples/numerics.py --flip-rank 2 --flip-step 30
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

import agent


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--fingerprint-every", type=int, default=None,
                   help="agent.init(fingerprint_every=N); default: TRACEML_FINGERPRINT_EVERY")
    p.add_argument("--layer", default="2.weight",
                   help="the parameter the faults below touch (name in the unwrapped model)")
    p.add_argument("--flip-rank", type=int, default=None, help="this rank moves one element of --layer ...")
    p.add_argument("--flip-step", type=int, default=30, help="... by one ULP after this step's optimizer step")
    p.add_argument("--nan-rank", type=int, default=None, help="this rank sets one gradient value of --layer ...")
    p.add_argument("--nan-step", type=int, default=40, help="... to NaN before this step's optimizer step")
    p.add_argument("--lr-from", type=int, default=None, help="from this step on, --layer's learning rate ...")
    p.add_argument("--lr-scale", type=float, default=2.0, help="... is multiplied by this")
    return p.parse_args()


def build_model(dim: int, hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 1))


def main() -> None:
    args = parse_args()
    distributed = "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    if args.fingerprint_every is None:
        agent.init()
    else:
        agent.init(fingerprint_every=args.fingerprint_every)

    torch.manual_seed(args.seed)
    inner = build_model(args.dim, args.hidden)
    touched = dict(inner.named_parameters())[args.layer]
    model: nn.Module = nn.parallel.DistributedDataParallel(inner) if distributed else inner
    # The touched layer in a group of its own, so its learning rate can change alone.
    others = [p for p in inner.parameters() if p is not touched]
    opt = torch.optim.SGD([{"params": others}, {"params": [touched]}], lr=0.01)
    gen = torch.Generator().manual_seed(args.seed + 1000 * rank)

    for step in range(args.steps):
        x = torch.randn(16, args.dim, generator=gen)
        y = torch.randn(16, 1, generator=gen)
        if args.lr_from is not None and step == args.lr_from:
            opt.param_groups[1]["lr"] *= args.lr_scale
        with agent.trace_step(model):
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if rank == args.nan_rank and step == args.nan_step and touched.grad is not None:
                touched.grad.view(-1)[1] = float("nan")
            opt.step()
            if rank == args.flip_rank and step == args.flip_step:
                with torch.no_grad():
                    flat = touched.view(-1)
                    flat[3] = torch.nextafter(flat[3], torch.tensor(float("inf")))
        agent.log(loss=loss.detach())

    agent.shutdown()
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
