"""Real 2-rank gloo jobs on CPU (torch.multiprocessing spawn): DDP comm timing and FSDP2."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

MS = 1_000_000
STEPS = 4



def _finish() -> None:
    """End a spawned worker. Its results are already on disk. Plain FSDP2 on gloo
    (no TraceML involved) aborts in about 1 exit in 8 here with "terminate called
    without an active exception" from a C++ destructor at interpreter teardown,
    so skip the teardown instead of letting that torch bug fail the test."""
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _init(rank: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)


def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])


class SlowFirst(torch.nn.Module):
    """Rank 1 is slow in forward, so rank 0 waits in the all-reduce."""

    def __init__(self, inner: torch.nn.Module, sleep_s: float) -> None:
        super().__init__()
        self.inner = inner
        self.sleep_s = sleep_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.sleep_s)
        return self.inner(x)


def _ddp_worker(rank: int, port: int, out: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from agent.recorder import Recorder
    from agent.tracer import Tracer

    _init(rank, port)
    recorder = Recorder()
    tracer = Tracer(recorder, event_backend=None, deep_dive=True, deep_dive_every=1000)
    tracer.install()
    # small buckets: several all-reduces per step
    traced = DDP(SlowFirst(_mlp(), 0.15 if rank == 1 else 0.0), bucket_cap_mb=0.02)
    plain = DDP(_mlp(), bucket_cap_mb=0.02)  # untraced twin: gradients must match
    user_hooked = DDP(_mlp())
    user_hooked.register_comm_hook(None, allreduce_hook)  # the user's hook wins
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (traced, plain, user_hooked)]
    torch.manual_seed(1 + rank)
    for _ in range(STEPS):
        x = torch.randn(8, 64)
        with tracer.trace_step(traced):
            traced(x).pow(2).sum().backward()
            opts[0].step()
        plain(x).pow(2).sum().backward()
        opts[1].step()
        with tracer.trace_step(user_hooked):
            user_hooked(x).pow(2).sum().backward()
            opts[2].step()
        for opt in opts:
            opt.zero_grad()
    same = all(torch.allclose(a, b) for a, b in zip(traced.module.inner.parameters(), plain.parameters(),
                                                       strict=True))
    tracer.poll()  # finished steps become rows on the sender thread's poll
    tables = recorder.drain()
    result = {"tables": tables, "same_params": same, "parallelism": tracer.parallelism()}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    tracer.uninstall()
    _finish()


def _fsdp_worker(rank: int, port: int, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    from agent.recorder import Recorder
    from agent.tracer import Tracer

    _init(rank, port)
    recorder = Recorder()
    tracer = Tracer(recorder, event_backend=None, deep_dive=True, deep_dive_every=1)
    tracer.install()
    results: dict[str, Any] = {}
    for label, shard_root in (("root", True), ("inner", False)):
        model = _mlp()
        full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        for layer in model:
            fully_shard(layer)
        if shard_root:
            fully_shard(model)
        hooks_before = {name: (len(m._forward_pre_hooks), len(m._forward_hooks)) for name, m in model.named_modules()}
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            with tracer.trace_step(model):
                model(torch.randn(4, 64)).sum().backward()
                opt.step()
                opt.zero_grad()
        hooks_after = {name: (len(m._forward_pre_hooks), len(m._forward_hooks)) for name, m in model.named_modules()}
        changed = [name for name in hooks_before if hooks_before[name] != hooks_after[name]]
        results[label] = {"full_bytes": full_bytes, "changed": changed}
    tracer.poll()
    results["tables"] = recorder.drain()
    results["parallelism"] = tracer.parallelism()
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    tracer.uninstall()
    _finish()


def _spawn(worker: Any, tmp_path: Path) -> list[dict[str, Any]]:
    mp.spawn(worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_ddp_allreduce_is_measured(tmp_path: Path) -> None:
    ranks = _spawn(_ddp_worker, tmp_path)
    for rank, res in enumerate(ranks):
        assert res["same_params"], "the timing comm hook changed the gradients"
        assert res["parallelism"] == "ddp"
        models = res["tables"]["models"]
        assert models["parallelism"] == ["ddp", "ddp"] and models["name"] == ["SlowFirst", "Sequential"]
        steps = res["tables"]["steps"]
        rows = [dict(zip(steps, vals, strict=True)) for vals in zip(*steps.values(), strict=True)]
        traced = [r for r in rows if r["model_id"] == 0]
        hooked = [r for r in rows if r["model_id"] == 1]
        assert len(traced) == STEPS and len(hooked) == STEPS
        for r in traced:
            assert r["comm_ns"] is not None and r["comm_ns"] > 0
            assert r["wait_ns"] is not None and r["backward_ns"] >= 0
            if rank == 0:
                # rank 1 enters backward 150 ms late: rank 0 is blocked inside backward for
                # what its own forward did not already use up (measured once: a 51 ms forward
                # on a loaded machine left 94 ms of backward + wait), so its step holds it all
                assert r["forward_ns"] + r["backward_ns"] + r["wait_ns"] >= 100 * MS, r
        if rank == 0:
            # ... and most of that block is measured as collective wait (on a loaded
            # 2-core box the last bucket's launch is occasionally delayed into backward)
            assert sum(r["wait_ns"] for r in traced) >= STEPS * 150 * MS // 2, traced
        for r in hooked:  # user comm hook kept: residual wait, no measured comm
            assert r["comm_ns"] is None and r["wait_ns"] is not None
        assert "layers" not in res["tables"] or 0 in res["tables"]["layers"]["step"]


def test_fsdp2_reports_shards_and_adds_no_layer_hooks(tmp_path: Path) -> None:
    ranks = _spawn(_fsdp_worker, tmp_path)
    for res in ranks:
        assert res["parallelism"] == "fsdp2"
        models = res["tables"]["models"]
        assert models["parallelism"] == ["fsdp2", "fsdp2"]
        for i, label in enumerate(("root", "inner")):
            full = res[label]["full_bytes"]
            assert models["estimated_full_bytes"][i] == full
            local = models["local_shard_bytes"][i]
            assert abs(local - full // 2) <= full // 50, (local, full)
            assert res[label]["changed"] == [""]  # only the traced root got our two hooks
        assert "layers" not in res["tables"]  # deep dive is off under FSDP2
        assert len(res["tables"]["steps"]["step"]) == 4


HANG_STEP = 1


def _hang_worker(rank: int, port: int, out: str, stuck: Any, release: Any) -> None:
    """Rank 1 blocks in a gradient hook during backward (as in examples/scenarios/hang.py)
    until rank 0 has looked at its own status; Events with timeouts keep the test finite."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from agent.recorder import Recorder
    from agent.tracer import Tracer

    _init(rank, port)
    tracer = Tracer(Recorder(), event_backend=None)
    tracer.install()
    inner = _mlp()
    step_box = [0]
    seen: dict[str, Any] = {}

    def block(grad: torch.Tensor) -> torch.Tensor:
        if rank == 1 and step_box[0] == HANG_STEP:
            seen["own"] = tracer.status()  # what this rank reports while it is the stuck one
            stuck.set()
            seen["released"] = release.wait(60)
        return grad

    inner[0].weight.register_hook(block)  # first layer: its bucket is the last to be launched
    model = DDP(inner)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watcher: threading.Thread | None = None
    if rank == 0:

        def watch() -> None:
            if not stuck.wait(60):
                seen["own"] = {"phase": "rank 1 never blocked"}
                release.set()
                return
            # Rank 0 may still be between phases of the same step (a transient "wait"
            # between forward and backward): record the phase it settles in, the one it
            # keeps while blocked, i.e. one entered at least 0.5 s ago.
            deadline = time.monotonic() + 20
            status = tracer.status()
            while time.time() - status["phase_since"] < 0.5 and time.monotonic() < deadline:
                time.sleep(0.01)
                status = tracer.status()
            seen["own"] = status
            release.set()

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
    for step in range(3):
        step_box[0] = step
        with tracer.trace_step(model):
            model(torch.randn(8, 64)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
    if watcher is not None:
        watcher.join(30)
    seen["after"] = tracer.status()
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
    tracer.uninstall()
    _finish()


def test_status_shows_wait_on_the_rank_waiting_for_a_hung_peer(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    stuck, release = ctx.Event(), ctx.Event()
    mp.spawn(_hang_worker, args=(_free_port(), str(tmp_path), stuck, release), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    # The stuck rank is inside backward; the healthy one waits in the all-reduce for it:
    # exactly the split the daemon's liveness check needs to name rank 1 in a HANG.
    assert r1["own"]["phase"] == "backward" and r1["own"]["step"] == HANG_STEP, r1
    assert r0["own"]["phase"] == "wait" and r0["own"]["step"] == HANG_STEP, r0
    assert r1["released"] is True
    for res in (r0, r1):  # once released, the job goes on and the status moves past the hang
        assert res["after"]["phase"] == "idle" and res["after"]["steps_done"] == 3
