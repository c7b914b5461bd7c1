"""Shared loop of the scenario scripts: a small DDP MLP on CPU (gloo).

Each scenario changes one thing (a slow collate, a slow optimizer on one
rank, a leak ...) through the hooks below, so the difference between
scenarios is exactly the behaviour the diagnosis must name.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import agent


@dataclass
class Scenario:
    collate_delay_s: Callable[[int], float] = lambda rank: 0.0
    optimizer_delay_s: Callable[[int], float] = lambda rank: 0.0
    backward_delay_s: Callable[[int, int], float] = lambda rank, step: 0.0  # (rank, step) -> seconds
    # Host work after backward and before optimizer.step: in no phase the agent measures.
    between_delay_s: Callable[[int], float] = lambda rank: 0.0
    leak_bytes_per_step: Callable[[int], int] = lambda rank: 0
    call_forward_directly: bool = False  # bypasses module hooks: the forward phase is never captured
    batch: int = 128  # default of --batch
    # Per step, the host thread waits this long inside forward, as it waits on the
    # device in a GPU job. Without it two compute-bound ranks fill this 2-core
    # machine, and the host-CPU verdict (median >= 95% busy) is a true finding.
    device_wait_s: float = 0.0


def parse_args(default_batch: int = 128) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=default_batch)
    p.add_argument("--hidden", type=int, default=512, help="MLP width")
    p.add_argument("--ms", type=float, default=30.0, help="size of the injected delay, ms")
    return p.parse_args()


def _collate(delay_s: float) -> Callable[[list], tuple[torch.Tensor, torch.Tensor]]:
    def collate(items: list) -> tuple[torch.Tensor, torch.Tensor]:
        if delay_s:
            time.sleep(delay_s)
        xs, ys = zip(*items, strict=True)
        return torch.stack(xs), torch.stack(ys)

    return collate


class _SlowStepSGD(torch.optim.SGD):
    def __init__(self, params, lr: float, delay_s: float) -> None:  # type: ignore[no-untyped-def]
        super().__init__(params, lr=lr)
        self.delay_s = delay_s

    def step(self, closure=None):  # type: ignore[no-untyped-def,override]
        if self.delay_s:
            time.sleep(self.delay_s)
        return super().step(closure)


def run(scenario: Scenario) -> None:
    args = parse_args(scenario.batch)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    agent.init()
    torch.manual_seed(0)
    h = args.hidden
    model: nn.Module = nn.Sequential(nn.Linear(64, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 1))
    step_box = [0]
    delay = scenario.backward_delay_s
    first = model[0]
    # A gradient hook on the first layer runs inside the backward pass: the delay lands in backward.
    first.weight.register_hook(lambda g: (time.sleep(delay(rank, step_box[0])), g)[1])
    if scenario.device_wait_s:
        first.register_forward_pre_hook(lambda module, inputs: time.sleep(scenario.device_wait_s))
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    opt = _SlowStepSGD(model.parameters(), lr=0.01, delay_s=scenario.optimizer_delay_s(rank))
    gen = torch.Generator().manual_seed(rank)
    data = TensorDataset(torch.randn(args.steps * args.batch, 64, generator=gen),
                         torch.randn(args.steps * args.batch, 1, generator=gen))
    loader = DataLoader(data, batch_size=args.batch, collate_fn=_collate(scenario.collate_delay_s(rank)))
    between_s = scenario.between_delay_s(rank)
    leak: list[torch.Tensor] = []
    for step, (x, y) in enumerate(loader):
        step_box[0] = step
        with agent.trace_step(model):
            out = model.forward(x) if scenario.call_forward_directly else model(x)
            loss = nn.functional.mse_loss(out, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if between_s:
                time.sleep(between_s)
            opt.step()
            n = scenario.leak_bytes_per_step(rank)
            if n:
                leak.append(torch.ones(n // 4))  # retained forever: the memory creep
        agent.log(loss=loss.detach())
    agent.shutdown()
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


def ms(args_ms: float | None = None) -> float:
    return (args_ms if args_ms is not None else parse_args().ms) / 1000.0
