"""Training-thread cost of numerics fingerprints (``agent.init(fingerprint_every=N)``), CPU.

The CPU test model (``examples/train.py``'s MLP: 64 -> 256 -> 256 -> 256 -> 1,
SGD, the model of the end-to-end tests) runs real forward/backward/SGD steps
under an installed ``Tracer`` in three modes, interleaved block by block in one
process so a noisy machine hits them alike, each with its own copy of the
model (same weights) and its own tracer:

* ``off``: fingerprints off (the baseline every figure is taken against);
* ``every1``: ``fingerprint_every=1``, a fingerprint at every step's exit;
* ``default``: ``fingerprint_every=DEFAULT_FINGERPRINT_EVERY`` (the default interval);
* ``before``: ``fingerprint_every=1`` with the method fingerprints used before
  bit sums (``LegacyFingerprint``: one fused ``_foreach_norm`` accumulated in
  float64, then a finiteness test of the gradient norms), the same-run baseline
  of the change.

Each step is timed around ``with tracer.trace_step(model)`` (its exit, where
the fingerprint is taken, included) on the wall clock and the thread's CPU
clock. Figures: per mode the median step, and the cost against ``off`` as the
median over rounds of (mode's median - off's median) / off's median, with
the min..max over rounds. Since one fingerprint in 50 steps is far below the
noise of a step, the default interval's cost is also given as derived: the
``every1`` cost divided by the interval. The sender thread's work (``poll``: reading the
values back and building rows) is timed apart: it is not the training
thread's. ``--batch`` sets the step's size (the fingerprint's cost does not
depend on it). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import json
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from train import build_model  # noqa: E402

from agent.config import DEFAULT_FINGERPRINT_EVERY  # noqa: E402
from agent.fingerprint import ModelFingerprint, Taken  # noqa: E402
from agent.recorder import Recorder  # noqa: E402
from agent.tracer import Tracer  # noqa: E402

MODES = {"off": 0, "every1": 1, "default": DEFAULT_FINGERPRINT_EVERY, "before": 1}


class LegacyFingerprint(ModelFingerprint):
    """The earlier method, for the same-run comparison: float64 norms, no bit sums."""

    __slots__ = ()

    def compute(self) -> Taken | None:
        with torch.no_grad():
            with_grad = [i for i, p in enumerate(self.params) if p.grad is not None]
            grads = [self.params[i].grad for i in with_grad]
            norms = torch.stack(torch._foreach_norm(self.params + grads, 2, dtype=torch.float64))
            finite = bool(torch.isfinite(norms[len(self.params):]).all())
            counts = [0] * len(grads) if finite else [int((~torch.isfinite(g)).sum()) for g in grads]  # type: ignore[arg-type]
            return Taken(norms.tolist(), torch.zeros(len(self.params), dtype=torch.int32), with_grad, counts)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32, help="samples per step (default 32, as the e2e tests)")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=200, help="timed steps per block")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps before each block")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the tests run 1)")
    p.add_argument("--ddp", type=int, default=0, metavar="N",
                   help="run as N spawned gloo ranks, every model wrapped in DistributedDataParallel "
                        "(the replica-divergence setting of the e2e tests); rank 0 reports")
    return p.parse_args()


class Mode:
    def __init__(self, name: str, every: int, model: torch.nn.Module) -> None:
        self.name = name
        self.recorder = Recorder()
        self.tracer = Tracer(self.recorder, event_backend=None, fingerprint_every=every)
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=0.01)
        self.wall: list[list[int]] = []  # per round, each timed step
        self.cpu: list[list[int]] = []
        self.poll_ns: list[int] = []
        self.rows = 0
        self.take_ns: list[int] = []  # each fingerprint's take(), timed in place on the training thread
        fps = self.tracer._fingerprints
        if fps is not None and name == "before":
            fps.for_model = lambda model_id, m: LegacyFingerprint(model_id, m)
        if fps is not None:
            take = fps.take

            def timed_take(*a: Any, _take: Any = take, _out: list[int] = self.take_ns) -> None:
                t0 = time.perf_counter_ns()
                _take(*a)
                _out.append(time.perf_counter_ns() - t0)

            fps.take = timed_take


def run_block(mode: Mode, x: torch.Tensor, y: torch.Tensor, warmup: int, steps: int) -> None:
    tracer, model, opt = mode.tracer, mode.model, mode.opt
    tracer.install()
    wall: list[int] = []
    cpu: list[int] = []
    for i in range(warmup + steps):
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        with tracer.trace_step(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        w1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        if i >= warmup:
            wall.append(w1 - w0)
            cpu.append(c1 - c0)
    tracer._remove_patches()  # the next mode's tracer patches alone
    t0 = time.perf_counter_ns()
    tracer.poll()
    mode.poll_ns.append(time.perf_counter_ns() - t0)
    mode.rows += len(mode.recorder.drain().get("fingerprints", {}).get("step", []))
    mode.wall.append(wall)
    mode.cpu.append(cpu)


def cost(mode: Mode, base: Mode, clock: str) -> dict[str, float]:
    """Per round (mode's median - base's median) / base's median, in percent: median, min, max."""
    a, b = getattr(mode, clock), getattr(base, clock)
    pcts = [100.0 * (statistics.median(m) - statistics.median(o)) / statistics.median(o) for m, o in zip(a, b,
                                                                                                       strict=True)]
    return {"pct": round(statistics.median(pcts), 3), "min": round(min(pcts), 3), "max": round(max(pcts), 3)}


def main() -> None:
    args = parse_args()
    if args.ddp > 1:
        port = _free_port()
        torch.multiprocessing.spawn(_ddp_rank, args=(args, port), nprocs=args.ddp, join=True)
    else:
        measure(args)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ddp_rank(rank: int, args: argparse.Namespace, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ddp)
    try:
        measure(args, rank=rank, wrap=torch.nn.parallel.DistributedDataParallel)
    finally:
        dist.destroy_process_group()


def measure(args: argparse.Namespace, rank: int = 0, wrap: Any = None) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model(64, 256, 4)
    x, y = torch.randn(args.batch, 64), torch.randn(args.batch, 1)
    # Every rank builds its modes (and under DDP their process-group collectives) in the same order.
    modes = [Mode(name, every, wrap(copy.deepcopy(model)) if wrap else copy.deepcopy(model))
             for name, every in MODES.items()]
    for r in range(args.rounds):
        for k in range(len(modes)):
            run_block(modes[(r + k) % len(modes)], x, y, args.warmup, args.steps)
    if rank != 0:
        return
    off = modes[0]
    out: dict[str, Any] = {"batch": args.batch, "threads": args.threads, "rounds": args.rounds,
                           "steps_per_block": args.steps, "default_every": DEFAULT_FINGERPRINT_EVERY,
                           "ddp_ranks": args.ddp if wrap else 0}
    setting = f"DDP over gloo, {args.ddp} ranks (rank 0 reports)" if wrap else "one process"
    print(f"CPU test model (examples/train.py MLP, {sum(p.numel() for p in model.parameters())} parameters in "
          f"{len(list(model.parameters()))} tensors), batch {args.batch}, {setting}, {args.threads} thread(s), "
          f"{args.rounds} rounds x {args.steps} steps per mode")
    for clock in ("wall", "cpu"):
        base_us = statistics.median(statistics.median(b) for b in getattr(off, clock)) / 1000
        out[f"{clock}_off_step_us"] = round(base_us, 1)
        print(f"[{clock}] off (baseline): median step {base_us:.1f} us")
        for mode in modes[1:]:
            med = statistics.median(statistics.median(b) for b in getattr(mode, clock)) / 1000
            c = cost(mode, off, clock)
            out[f"{clock}_{mode.name}_step_us"] = round(med, 1)
            out[f"{clock}_{mode.name}_pct"] = c["pct"]
            out[f"{clock}_{mode.name}_pct_range"] = [c["min"], c["max"]]
            print(f"[{clock}] {mode.name:8s}: median step {med:.1f} us, cost {c['pct']:+.2f}% of the step "
                  f"(rounds {c['min']:+.2f}..{c['max']:+.2f}%)")
        derived = out[f"{clock}_every1_pct"] / DEFAULT_FINGERPRINT_EVERY
        out[f"{clock}_default_derived_pct"] = round(derived, 4)
        print(f"[{clock}] default derived: every1 cost / {DEFAULT_FINGERPRINT_EVERY} = {derived:+.3f}% of the step")
    every1 = modes[1]
    take_us = statistics.median(every1.take_ns) / 1000
    off_us = out["wall_off_step_us"]
    out["take_us"] = round(take_us, 1)
    out["in_place_every1_pct"] = round(100 * take_us / off_us, 3)
    out["in_place_default_pct"] = round(100 * take_us / DEFAULT_FINGERPRINT_EVERY / off_us, 4)
    print(f"in place: one fingerprint (take() at step exit) {take_us:.1f} us (median of {len(every1.take_ns)}) = "
          f"{out['in_place_every1_pct']:.2f}% of the off step at every step, "
          f"{out['in_place_default_pct']:.3f}% at every {DEFAULT_FINGERPRINT_EVERY}th")
    before = modes[3]
    before_us = statistics.median(before.take_ns) / 1000
    out["before_take_us"] = round(before_us, 1)
    out["before_in_place_every1_pct"] = round(100 * before_us / off_us, 3)
    print(f"before (float64 norms, no bit sums), same run: one fingerprint {before_us:.1f} us = "
          f"{out['before_in_place_every1_pct']:.2f}% of the off step; now {take_us / before_us:.2f}x of it")
    per_fp_poll = statistics.median(every1.poll_ns) / (args.steps + args.warmup) / 1000
    out["sender_poll_us_per_fingerprint"] = round(per_fp_poll, 1)
    out["rows"] = {m.name: m.rows for m in modes}
    print(f"sender thread: poll() reads back and builds rows in {per_fp_poll:.1f} us per fingerprint "
          f"(not the training thread's); rows: {out['rows']}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
