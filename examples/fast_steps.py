"""A tiny model stepped as fast as the CPU allows (a few hundred microseconds a step).

Stresses the agent's queues rather than the model: with steps this short the
recorder, the batches and the relay see thousands of step rows a second, and
the delivery contract says every one of them still arrives. Used by
tests/e2e/test_fast_steps.py; runs under plain ``python`` or ``torchrun``.

    python examples/fast_steps.py --steps 100000
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import agent


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100_000, help="training steps")
    p.add_argument("--dim", type=int, default=8, help="width of the single linear layer")
    p.add_argument("--batch", type=int, default=4)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # intra-op threads only add overhead at this size
    agent.init()
    torch.manual_seed(0)
    model = nn.Linear(args.dim, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # One fixed batch: data loading is not what this script measures, and a
    # DataLoader would dominate a step this short.
    x, y = torch.randn(args.batch, args.dim), torch.randn(args.batch, 1)
    for _ in range(args.steps):
        with agent.trace_step(model):
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    agent.shutdown()
    print(f"fast_steps: done {args.steps} steps", flush=True)


if __name__ == "__main__":
    main()
