"""An asynchronous RL rollout workflow traced by TraceML: rollout sessions feeding a trainer.

Each rank runs, in one asyncio event loop, a rollout producer and a trainer:

* the producer takes prompts (tasks), generates ``--n-samples`` samples per task
  concurrently against a stand-in inference engine (heavy-tailed latency, a tool
  call now and then), scores each with a reward function, and accepts it or
  rejects it as stale (generated against weights too old), like an async GRPO
  pipeline;
* the trainer waits for a batch of accepted samples, then runs one DDP step of a
  small policy model under ``agent.trace_step``.

The TraceML lines: ``agent.set_task_id()``, ``@agent.session_context()``,
``agent.trace_session_phase(...)``, ``@agent.trace_session("reward")``,
``agent.trace_session_event("mark_finalized", ...)``, ``@agent.trace_perf``,
``agent.span(..., category="scheduler")`` and ``agent.trace_step(model)``.

    torchrun --nproc-per-node 2 examples/rl_rollout.py --steps 12
    traceml-daemon sessions --db traceml.db
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

import agent


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12, help="trainer steps per rank")
    p.add_argument("--batch", type=int, default=8, help="accepted samples per trainer step")
    p.add_argument("--n-samples", type=int, default=4, help="samples (sessions) per task")
    p.add_argument("--concurrency", type=int, default=6, help="tasks in flight at once")
    p.add_argument("--base-latency-s", type=float, default=0.004, help="the engine's typical generate time")
    p.add_argument("--tail-alpha", type=float, default=1.1, help="Pareto shape of generate latency (lower: longer tail)")
    p.add_argument("--stale-frac", type=float, default=0.4, help="share of samples rejected as stale")
    p.add_argument("--tool-frac", type=float, default=0.25, help="share of samples that call a tool")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", default=None, help="write this rank's counts as JSON to REPORT.<rank>")
    return p.parse_args()


@dataclass
class Sample:
    session_id: int
    tokens: int
    reward: float
    version: int


class StandInEngine:
    """An inference engine stand-in: generate latency is Pareto (a long tail), capped."""

    def __init__(self, rng: random.Random, base_s: float, alpha: float) -> None:
        self.rng = rng
        self.base_s = base_s
        self.alpha = alpha
        self.version = 0  # the policy weights' version the engine serves

    @agent.trace_perf("engine.agenerate", category="io")
    async def agenerate(self, prompt: int) -> tuple[int, int]:
        version = self.version
        await asyncio.sleep(min(1.0, self.base_s * self.rng.paretovariate(self.alpha)))
        return 16 + (prompt * 7919) % 48, version

    async def call_tool(self) -> None:
        await asyncio.sleep(self.base_s * (1 + self.rng.random()))


@agent.trace_session("reward")
def reward_fn(prompt: int, tokens: int) -> float:
    # A little CPU work, on the event loop like a cheap rule-based reward.
    return float(sum((prompt * k + tokens) % 13 for k in range(200)) % 7) / 7.0


class Workflow:
    def __init__(self, engine: StandInEngine, rng: random.Random, args: argparse.Namespace,
                 counts: dict[str, int]) -> None:
        self.engine = engine
        self.rng = rng
        self.args = args
        self.counts = counts

    @agent.session_context()
    async def collect(self, prompt: int) -> Sample:
        self.counts["registered"] += 1
        async with agent.trace_session_phase("generate", start_payload={"prompt": prompt}):
            tokens, version = await self.engine.agenerate(prompt)
        if self.rng.random() < self.args.tool_frac:
            async with agent.trace_session_phase("toolcall", end_payload={"tool": "calculator"}):
                await self.engine.call_tool()
        reward = reward_fn(prompt, tokens)
        sid = agent.current_session_id()
        return Sample(sid or 0, tokens, reward, version)

    async def arun_episode(self, prompt: int, out: asyncio.Queue[Sample], counts: dict[str, int]) -> None:
        task = agent.set_task_id()
        try:
            samples = await asyncio.gather(*(self.collect(prompt) for _ in range(self.args.n_samples)))
        except asyncio.CancelledError:
            # Training ended with this episode in flight: every session of the task is dropped.
            agent.trace_session_event("mark_finalized", task_id=task, status="dropped", reason="training_ended")
            raise
        for s in samples:
            if self.rng.random() < self.args.stale_frac:
                agent.trace_session_event("mark_finalized", session_id=s.session_id, status="rejected",
                                          reason="stale_weight")
                counts["rejected"] += 1
            else:
                agent.trace_session_event("mark_finalized", session_id=s.session_id, status="accepted")
                counts["accepted"] += 1
                await out.put(s)


async def produce(workflow: Workflow, out: asyncio.Queue[Sample], counts: dict[str, int], rank: int) -> None:
    """Keep ``--concurrency`` episodes in flight until cancelled."""
    prompt = rank * 1_000_000
    running: set[asyncio.Task[None]] = set()
    try:
        while True:
            while len(running) < workflow.args.concurrency:
                prompt += 1
                counts["tasks"] += 1
                task = asyncio.create_task(workflow.arun_episode(prompt, out, counts))
                running.add(task)
                task.add_done_callback(running.discard)
            agent.instant("rollout.queue", category="scheduler", size=out.qsize(), in_flight=len(running))
            await asyncio.sleep(0.002)
    except asyncio.CancelledError:
        for task in list(running):
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        raise


async def train(args: argparse.Namespace, rank: int) -> dict[str, int]:
    rng = random.Random(args.seed * 1000 + rank)
    torch.manual_seed(args.seed)
    model: nn.Module = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    if dist.is_initialized():
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    engine = StandInEngine(rng, args.base_latency_s, args.tail_alpha)
    queue: asyncio.Queue[Sample] = asyncio.Queue()
    counts = {"tasks": 0, "registered": 0, "accepted": 0, "rejected": 0, "steps": 0}
    producer = asyncio.create_task(produce(Workflow(engine, rng, args, counts), queue, counts, rank))
    for step in range(args.steps):
        async with agent.span("trainer.wait_rollouts", category="scheduler", global_step=step):
            batch = [await queue.get() for _ in range(args.batch)]
        with agent.trace_step(model):
            x = torch.tensor([[s.reward, s.tokens / 64, s.version, *([0.5] * 5)] for s in batch])
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        agent.log(loss=loss.detach())
        engine.version += 1  # the engine serves the new weights from now on
        counts["steps"] += 1
    producer.cancel()
    try:
        await producer
    except asyncio.CancelledError:
        pass
    return counts


def main() -> None:
    args = parse_args()
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    agent.init()
    counts = asyncio.run(train(args, rank))
    sessions = counts["accepted"] + counts["rejected"]
    print(f"rank {rank}: done {counts['steps']} steps, {counts['registered']} sessions: {sessions} finalized "
          f"({counts['accepted']} accepted, {counts['rejected']} rejected) from {counts['tasks']} tasks, the rest "
          "dropped at the end", flush=True)
    if args.report:
        with open(f"{args.report}.{rank}", "w", encoding="utf-8") as fh:
            json.dump(counts, fh)
    agent.shutdown()
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
