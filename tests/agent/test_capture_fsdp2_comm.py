"""FSDP2 collective timing (agent/capture/fsdp2_comm.py): real gloo FSDP2 jobs on CPU
(2 ranks, and HSDP on a 2 x 2 mesh), and the device path driven by a fake backend."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from agent.capture import fsdp2_comm
from agent.device_sampling import EVERY_STEP
from agent.recorder import Recorder
from agent.tracer import Tracer
from tests.agent.test_capture_events import FakeBackend

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

MS = 1_000_000
STEPS = 4
SLOW_S = 0.08


class SlowBackward(torch.autograd.Function):
    """Identity forward; backward sleeps: the rank's own compute in backward is slow."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sleep_s: float) -> torch.Tensor:
        ctx.sleep_s = sleep_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.sleep_s)
        return grad, None


class Net(torch.nn.Module):
    def __init__(self, sleep_s: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(3))
        self.sleep_s = sleep_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == 1 and self.sleep_s:
                x = SlowBackward.apply(x, self.sleep_s)
        return x


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _shard(model: Net, mesh: Any = None) -> Net:
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train(model: Net, tracer: Tracer | None, seed: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        x = torch.randn(8, 32, generator=gen)
        if tracer is None:
            model(x).sum().backward()
        else:
            with tracer.trace_step(model):
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
                continue
        opt.step()
        opt.zero_grad()


def _worker(rank: int, port: int, out: str, world: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives

    mesh = None
    if world == 4:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    notices: list[str] = []
    recorder = Recorder()
    tracer = Tracer(recorder, event_backend=None, deep_dive=True, warn=lambda kind, msg: notices.append(kind))
    tracer.install()
    sleep_s = SLOW_S if rank == 1 and world == 2 else 0.0
    traced = _shard(Net(sleep_s), mesh)
    _train(traced, tracer, seed=rank)
    proxied = isinstance(collectives.dist, fsdp2_comm.TimedDist)
    calls = fsdp2_comm.timer().calls  # type: ignore[union-attr]
    tracer.poll()
    tables = recorder.drain()
    tracer.uninstall()
    restored = collectives.dist is dist
    plain = _shard(Net(sleep_s), mesh)  # untraced twin on the same data: same parameters expected
    _train(plain, None, seed=rank)
    same = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in
               zip(traced.parameters(), plain.parameters(), strict=True))
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "tables": tables, "proxied": proxied, "restored": restored, "calls": calls, "same": same,
        "notices": notices}))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # see tests/agent/test_capture_ddp.py: FSDP2 on gloo may abort at teardown


def _spawn(tmp_path: Path, world: int) -> list[dict[str, Any]]:
    mp.spawn(_worker, args=(_free_port(), str(tmp_path), world), nprocs=world, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def _rows(table: dict[str, list[Any]]) -> list[dict[str, Any]]:
    return [dict(zip(table, vals, strict=True)) for vals in zip(*table.values(), strict=True)]


def test_fsdp2_collectives_are_timed_per_phase_and_change_nothing(tmp_path: Path) -> None:
    ranks = _spawn(tmp_path, 2)
    for res in ranks:
        assert res["proxied"] and res["restored"]
        assert res["same"], "timing the collectives changed what FSDP2 computed"
        # 3 units: an all-gather each in forward, again in backward, and a reduce-scatter
        assert res["calls"] == STEPS * 9
        assert res["notices"] == ["notice:deep_dive_fsdp2"]
        assert "layers" not in res["tables"]
        models = _rows(res["tables"]["models"])
        assert [(m["shard_degree"], m["replicate_degree"]) for m in models] == [(2, None)]
        for row in _rows(res["tables"]["steps"]):
            assert row["fwd_comm_ns"] > 0 and row["bwd_comm_ns"] > 0, row
            assert row["replicate_comm_ns"] == 0
            assert row["fwd_comm_ns"] <= row["forward_ns"] and row["bwd_comm_ns"] <= row["backward_ns"], row
            assert row["post_forward_bytes"] is None and row["peak_bytes"] is None  # CPU: not measured
            assert row["rss_bytes"] is not None and row["rss_bytes"] > 0
    waiting, slow = (_rows(r["tables"]["steps"]) for r in ranks)
    # Rank 1 sleeps in its own backward: rank 0 waits for it in the reduce-scatter. Rank 0's
    # backward collectives hold most of the sleep beyond rank 1's (loaded 2-core box: half).
    extra = sum(w["bwd_comm_ns"] - s["bwd_comm_ns"] for w, s in zip(waiting, slow, strict=True))
    assert extra >= STEPS * SLOW_S * 1e9 / 2, (waiting, slow)
    busy = [sum(r["backward_ns"] - r["bwd_comm_ns"] for r in rows) for rows in (waiting, slow)]
    assert busy[1] - busy[0] >= STEPS * SLOW_S * 1e9 / 2, busy


def test_hsdp_reports_both_mesh_dimensions(tmp_path: Path) -> None:
    ranks = _spawn(tmp_path, 4)
    for res in ranks:
        assert res["same"]
        models = _rows(res["tables"]["models"])
        assert [(m["shard_degree"], m["replicate_degree"]) for m in models] == [(2, 2)]
        for row in _rows(res["tables"]["steps"]):
            # the gradient all-reduce across replicas runs in backward, on the replicate dim
            assert 0 < row["replicate_comm_ns"] < row["bwd_comm_ns"], row
            assert row["fwd_comm_ns"] > 0


def test_device_path_brackets_each_collective_with_events() -> None:
    """On a device backend the two events around the call are kept, not the host launch time."""
    backend = FakeBackend()
    recorder = Recorder()
    tracer = Tracer(recorder, event_backend=backend, device_sampling=EVERY_STEP, event_timeout_s=3600)
    real = SimpleNamespace(all_gather_single=lambda *a, **k: time.sleep(0.01),
                           reduce_scatter_single=lambda *a, **k: time.sleep(0.02),
                           all_reduce=lambda *a, **k: time.sleep(0.03), ReduceOp="ops")
    proxy = fsdp2_comm.TimedDist(real, fsdp2_comm.Fsdp2Timer(tracer))  # type: ignore[arg-type]
    model = torch.nn.Linear(2, 2)
    proxy.all_gather_single()  # outside a step: not timed
    with tracer.trace_step(model):
        rec = tracer._active
        assert rec is not None
        proxy.all_gather_single()  # forward: no phase open -> forward bucket
        rec.bwd_depth = 1  # as the backward wrapper sets it
        proxy.reduce_scatter_single()
        proxy.all_reduce()
        rec.bwd_depth = 0
    assert proxy.ReduceOp == "ops" and "ReduceOp" in vars(proxy)  # other names read through, then kept
    backend.complete_upto(len(backend.marked) - 1)
    tracer.poll()
    tracer.uninstall()
    (row,) = _rows(recorder.drain()["steps"])
    assert 10 * MS <= row["fwd_comm_ns"] < 20 * MS
    assert 50 * MS <= row["bwd_comm_ns"] < 80 * MS
    assert 30 * MS <= row["replicate_comm_ns"] < 50 * MS
    assert backend.live == set()


def test_steps_without_fsdp2_report_no_collective_time() -> None:
    recorder = Recorder()
    tracer = Tracer(recorder, event_backend=None)
    model = torch.nn.Linear(2, 2)
    with tracer.trace_step(model):
        model(torch.randn(1, 2)).sum().backward()
    tracer.poll()
    tracer.uninstall()
    (row,) = _rows(recorder.drain()["steps"])
    assert (row["fwd_comm_ns"], row["bwd_comm_ns"], row["replicate_comm_ns"], row["post_forward_bytes"]) == (
        None, None, None, None)


def test_a_notice_is_said_once_and_is_not_a_failure(capsys: pytest.CaptureFixture[str]) -> None:
    from agent.errors import ErrorReporter

    reporter = ErrorReporter()
    assert reporter.notice("tracer:notice:deep_dive_fsdp2", "deep dive skipped")
    assert not reporter.notice("tracer:notice:deep_dive_fsdp2", "deep dive skipped")
    assert capsys.readouterr().err == "[traceml] deep dive skipped\n"
    assert reporter.total() == 0


class Hold(torch.autograd.Function):
    """Identity; in backward, rank 1 blocks until rank 0 has looked at its own status."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, box: Any) -> torch.Tensor:
        ctx.box = box
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.box()
        return grad, None


def _hang_worker(rank: int, port: int, out: str, stuck: Any, release: Any) -> None:
    import threading

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    tracer = Tracer(Recorder(), event_backend=None)
    tracer.install()
    seen: dict[str, Any] = {}
    step_box = [0]

    def hold() -> None:
        if rank == 1 and step_box[0] == 1:
            seen["own"] = tracer.status()  # the stuck rank: in its own backward
            stuck.set()
            seen["released"] = release.wait(60)

    class Held(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.layers[0](x)
            x = Hold.apply(x, hold)  # between two units' backward
            return self.layers[2](self.layers[1](x))

    model = _shard(Held())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watcher: threading.Thread | None = None
    if rank == 0:

        def watch() -> None:
            if not stuck.wait(60):
                seen["own"] = {"phase": "rank 1 never blocked"}
                release.set()
                return
            # The phase rank 0 settles in while its peer is stuck: one entered 0.5 s ago or more.
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
            model(torch.randn(8, 32)).sum().backward()
            opt.step()
            opt.zero_grad()
    if watcher is not None:
        watcher.join(30)
    seen["after"] = tracer.status()
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
    tracer.uninstall()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def test_status_shows_wait_on_the_rank_blocked_in_an_fsdp2_collective(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    stuck, release = ctx.Event(), ctx.Event()
    mp.spawn(_hang_worker, args=(_free_port(), str(tmp_path), stuck, release), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    # What the daemon's liveness check needs to name rank 1 in a HANG under FSDP2 too.
    assert r1["own"]["phase"] == "backward" and r1["own"]["step"] == 1, r1
    assert r0["own"]["phase"] == "wait" and r0["own"]["step"] == 1, r0
    assert r1["released"] is True
    for res in (r0, r1):
        assert res["after"]["phase"] == "idle" and res["after"]["steps_done"] == 3
