"""A small training script traced by TraceML (DDP, FSDP2 or single process).

Runs under ``torchrun`` or plain ``python``, on the CPU with gloo by default, or
with ``--device cuda`` on GPUs (NCCL when every local rank has a GPU of its own,
gloo when ranks share one). Used by the demo and
the end-to-end tests, and a template for instrumenting a real script: the only
TraceML lines are ``agent.init()``, ``with agent.trace_step(model):``,
``agent.log(...)`` and ``agent.shutdown()``.

    torchrun --nproc-per-node 2 examples/train.py --steps 50
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

import agent


class SyntheticDataset(Dataset):
    """Deterministic random regression data (no downloads)."""

    def __init__(self, n: int, dim: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=gen)
        self.y = torch.randn(n, 1, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class SlowCollate:
    """Default collation plus a fixed sleep: simulates an input-bound rank."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def __call__(self, items: list) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay_s:
            time.sleep(self.delay_s)
        xs, ys = zip(*items, strict=True)
        return torch.stack(xs), torch.stack(ys)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100, help="training steps per rank")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP2 fully_shard instead of DDP")
    p.add_argument("--slow-ranks", default="", help="comma-separated global ranks whose collate sleeps")
    p.add_argument("--slow-nodes", default="", help="comma-separated node ranks (GROUP_RANK) whose collate sleeps")
    p.add_argument("--slow-ms", type=float, default=20.0, help="collate sleep of a slow rank, ms")
    p.add_argument("--seed", type=int, default=0, help="seeds the model and each rank's data")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: model on local rank's GPU, batches copied in the step (non_blocking, pinned)")
    p.add_argument(
        "--perturb-from",
        type=int,
        default=None,
        metavar="K",
        help="from step K on (0-based), shift every target by --perturb-by: a run that "
        "matches the unperturbed one bit for bit up to step K-1 (for `traceml-daemon compare`)",
    )
    p.add_argument("--perturb-by", type=float, default=1.0, help="target shift of --perturb-from")
    return p.parse_args()


def build_model(dim: int, hidden: int, layers: int) -> nn.Module:
    blocks: list[nn.Module] = [nn.Linear(dim, hidden), nn.ReLU()]
    for _ in range(layers - 2):
        blocks += [nn.Linear(hidden, hidden), nn.ReLU()]
    blocks.append(nn.Linear(hidden, 1))
    return nn.Sequential(*blocks)


def main() -> None:
    args = parse_args()
    distributed = "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    device = torch.device("cpu")
    backend = "gloo"
    if args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        gpus = torch.cuda.device_count()
        device = torch.device("cuda", local_rank % gpus)
        torch.cuda.set_device(device)
        # NCCL refuses two ranks on one GPU; gloo all-reduces CUDA tensors through the host.
        backend = "nccl" if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= gpus else "gloo"
    if distributed:
        dist.init_process_group(backend)
    rank = dist.get_rank() if distributed else 0
    node = int(os.environ.get("GROUP_RANK", "0"))
    agent.init()

    torch.manual_seed(args.seed)
    model: nn.Module = build_model(args.dim, args.hidden, args.layers).to(device)
    if distributed and args.fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model:
            if isinstance(block, nn.Linear):
                fully_shard(block)
        fully_shard(model)
    elif distributed:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    slow = str(rank) in args.slow_ranks.split(",") or str(node) in args.slow_nodes.split(",")
    dataset = SyntheticDataset(args.steps * args.batch, args.dim, seed=args.seed + rank)
    loader = DataLoader(dataset, batch_size=args.batch, collate_fn=SlowCollate(args.slow_ms / 1000 if slow else 0.0),
                        pin_memory=device.type == "cuda")

    for step, (x, y) in enumerate(loader):
        if args.perturb_from is not None and step >= args.perturb_from:
            # The data, not the lr: step K's own loss is computed from the shifted targets, so the
            # first logged loss that differs is step K's (an lr change would first show at K+1).
            y = y + args.perturb_by
        with agent.trace_step(model):
            if device.type == "cuda":
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        agent.log(loss=loss.detach())

    agent.shutdown()
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
