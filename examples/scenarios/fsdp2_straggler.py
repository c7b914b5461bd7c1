"""FSDP2 straggler: one rank computes slower in backward; the others wait for it inside
their own backward (the reduce-scatter of its gradients), so every rank's step and
backward look the same, and only the measured collective wait tells them apart.

    torchrun --nproc-per-node 2 examples/scenarios/fsdp2_straggler.py --steps 40 --ms 30
    torchrun --nproc-per-node 4 examples/scenarios/fsdp2_straggler.py --hsdp      # 2 x 2 mesh
    torchrun --nproc-per-node 2 examples/scenarios/fsdp2_straggler.py --ms 0      # balanced

CPU and gloo: a small MLP, every layer and the root sharded with ``fully_shard``.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import agent


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--ms", type=float, default=30.0, help="extra backward work of the slow rank, ms (0: balanced)")
    p.add_argument("--slow-rank", type=int, default=1)
    p.add_argument("--hidden", type=int, default=256, help="MLP width")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--hsdp", action="store_true", help="a 2-D mesh (replicate x shard): world size / 2 x 2")
    return p.parse_args()


class SlowBackward(torch.autograd.Function):
    """Identity in forward; sleeps in backward: the rank's own backward compute is slower."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, delay_s: float) -> torch.Tensor:
        ctx.delay_s = delay_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.delay_s)
        return grad, None


class MLP(nn.Module):
    def __init__(self, hidden: int, delay_s: float) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(64, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, 1)])
        self.delay_s = delay_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == 1 and self.delay_s:
                x = SlowBackward.apply(x, self.delay_s)  # between two units' backward
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


def main() -> None:
    args = parse_args()
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    agent.init()
    mesh = None
    if args.hsdp:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = MLP(args.hidden, args.ms / 1000.0 if rank == args.slow_rank else 0.0)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(args.steps):
        x = torch.randn(args.batch, 64, generator=gen)
        y = torch.randn(args.batch, 1, generator=gen)
        with agent.trace_step(model):
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        agent.log(loss=loss.detach())
    agent.shutdown()
    dist.barrier()
    dist.destroy_process_group()
    # FSDP2 on gloo sometimes aborts in a C++ destructor at interpreter teardown
    # ("terminate called without an active exception"), after everything is done.
    os._exit(0)


if __name__ == "__main__":
    main()
