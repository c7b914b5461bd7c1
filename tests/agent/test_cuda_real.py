"""The device path on a real GPU: CUDA events, H2D copies, per-step peak memory, lazy
scalars, NVML samplers and DDP's measured all-reduce.

Skipped where there is no CUDA device (this project's CI has none); run on a GPU
machine with ``bench/cuda_check.sh``. ``tests/agent/test_capture_events.py`` drives
the same code with a fake event backend on every machine.

"No sync" is checked without a clock: the GPU is given a long kernel
(``torch.cuda._sleep``) inside the step, and an event recorded right after the
step exit and ``log()`` must still be pending: had the agent synchronized the
device on the training thread, the GPU would have caught up with it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from agent.capture.events import CudaEventBackend
from agent.recorder import Recorder
from agent.samplers import GpuSampler, Nvml, ProcessSampler
from agent.tracer import Tracer
from tests.support.procs import base_env, free_port

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MS = 1_000_000
MB = 1 << 20


def _sleep_cycles_for(ms: float) -> tuple[int, int]:
    """Cycles of ``torch.cuda._sleep`` that keep the GPU busy about ``ms``, and the
    device time they took (measured with events, synchronized: this is test set-up)."""
    cycles = 1_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    per_cycle_ms = start.elapsed_time(end) / cycles
    cycles = int(ms / per_cycle_ms)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles, int(start.elapsed_time(end) * MS)


class GpuBusy(torch.nn.Module):
    """A real layer whose forward also keeps the GPU busy for a known device time."""

    def __init__(self, cycles: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(256, 256)
        self.cycles = cycles

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(self.cycles)
        return self.fc(x)


def _rows(table: dict[str, list[Any]]) -> list[dict[str, Any]]:
    return [dict(zip(table, vals, strict=True)) for vals in zip(*table.values(), strict=True)]


class Rows:
    """What the sender thread would ship: poll() then drain, kept per table across calls."""

    def __init__(self, tracer: Tracer, recorder: Recorder) -> None:
        self.tracer = tracer
        self.recorder = recorder
        self.got: dict[str, list[dict[str, Any]]] = {}

    def wait(self, table: str, n: int, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """Poll until ``n`` rows of ``table`` resolved (a liveness bound, not a timing assertion)."""
        deadline = time.monotonic() + timeout_s
        while len(self.got.get(table, [])) < n and time.monotonic() < deadline:
            self.tracer.poll()
            for name, cols in self.recorder.drain().items():
                self.got.setdefault(name, []).extend(_rows(cols))
            time.sleep(0.01)
        rows = self.got.get(table, [])
        assert len(rows) >= n, (table, list(self.got), self.tracer.counters())
        return rows


@pytest.fixture
def traced() -> Iterator[tuple[Tracer, Rows]]:
    recorder = Recorder()
    tracer = Tracer(recorder, event_timeout_s=120)  # the default backend: CUDA events here
    tracer.install()
    yield tracer, Rows(tracer, recorder)
    tracer.uninstall()


def test_phases_are_device_times_and_the_training_thread_never_waits_for_the_gpu(
        traced: tuple[Tracer, Rows]) -> None:
    tracer, out = traced
    assert isinstance(tracer._backend, CudaEventBackend)
    model = GpuBusy(0).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    host = torch.randn(4096, 256).pin_memory()  # 4 MiB: a copy long enough to see
    # One untraced step first: the first matmul creates cuBLAS's handle and the first
    # backward starts autograd's device thread, host work of tens of ms or more. Left
    # inside the traced steps, it let the GPU finish its sleeps before the host did
    # (seen once on an H100), and the check below read that as a sync.
    model(host.to("cuda")).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    cycles, busy_ns = _sleep_cycles_for(100.0)  # calibrated after the warm-up, clocks up
    model.cycles = cycles
    steps = 3
    torch.cuda.synchronize()
    losses = []
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call on this thread raises
    try:
        for _ in range(steps):
            with tracer.trace_step(model):
                x = host.to("cuda", non_blocking=True)
                loss = model(x).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            tracer.log(loss=loss)
            losses.append(loss.detach())
        behind = torch.cuda.Event()
        behind.record()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # The host is done with 3 steps; the GPU still has most of 3 x 100 ms of sleep to run.
    assert not behind.query(), "the training thread waited for the GPU"
    assert "steps" not in out.recorder.drain(), "rows must wait for their events, not for a sync"

    rows = out.wait("steps", steps)
    assert [r["step"] for r in rows] == list(range(steps))
    for r in rows:
        # Device time of forward holds the GPU sleep, which the host never waited for.
        assert r["forward_ns"] >= busy_ns * 0.9, (r, busy_ns)
        assert r["step_ns"] >= r["forward_ns"]
        assert r["h2d_ns"] is not None and r["h2d_ns"] > 0, r
        assert r["backward_ns"] > 0 and r["optimizer_ns"] > 0, r
        assert r["peak_bytes"] >= 4 * MB and r["reserved_bytes"] >= r["peak_bytes"], r
        assert r["comm_ns"] is None  # no DDP: wait is the residual
    scalars = out.wait("scalars", steps)
    expected = [float(v.item()) for v in losses]
    assert [s["step"] for s in scalars] == list(range(steps))
    assert [s["value"] for s in scalars] == pytest.approx(expected, rel=1e-6)
    counters = tracer.counters()
    assert counters["device_steps_dropped"] == 0 and counters["device_steps_fallback"] == 0, counters


def test_peak_memory_is_per_step_and_events_are_reused(traced: tuple[Tracer, Rows]) -> None:
    tracer, out = traced
    model = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    big = 256 * MB
    steps = 40
    for i in range(steps):
        with tracer.trace_step(model):
            x = torch.randn(8, 64, device="cuda")
            if i == 1:
                scratch = torch.empty(big, dtype=torch.uint8, device="cuda")
                scratch.fill_(1)
                del scratch
            model(x).sum().backward()
            opt.step()
        if i % 8 == 7:
            tracer.poll()  # the sender thread's cadence: events go back to the pool
    rows = out.wait("steps", steps)
    peaks = [r["peak_bytes"] for r in rows]
    assert peaks[1] >= big, peaks
    assert all(p < big for i, p in enumerate(peaks) if i != 1), peaks  # the reset is per step
    backend = tracer._backend
    assert isinstance(backend, CudaEventBackend)
    # Pooled: steady state records the same few events again instead of creating new ones.
    assert backend._created <= 8 * 10, backend._created
    assert backend.exhausted == 0


def test_copies_outside_a_step_are_charged_to_the_next_step(traced: tuple[Tracer, Rows]) -> None:
    tracer, out = traced
    model = torch.nn.Linear(256, 256).cuda()
    host = torch.randn(8192, 256).pin_memory()
    with tracer.trace_step(model):
        model(torch.zeros(1, 256, device="cuda")).sum().backward()
    x = host.cuda(non_blocking=True)  # prefetch between steps, as loaders often do
    with tracer.trace_step(model):
        model(x).sum().backward()
    first, second = out.wait("steps", 2)
    assert first["h2d_ns"] == 0
    assert second["h2d_ns"] > 0


def test_nvml_reads_the_real_gpu_and_this_process() -> None:
    nvml = Nvml()
    assert nvml.ok, "NVML did not load on a machine with a CUDA device"
    try:
        hold = torch.empty(512 * MB, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        gpus = GpuSampler(nvml).sample(time.time())
        assert len(gpus) == torch.cuda.device_count()
        for row in gpus:
            assert row["mem_total_bytes"] > 0 and 0 < row["mem_used_bytes"] <= row["mem_total_bytes"], row
            assert row["util_pct"] is not None and 0 <= row["util_pct"] <= 100, row
            assert row["temp_c"] is not None and row["temp_c"] > 0, row
            assert row["power_w"] is not None and row["power_w"] > 0, row
        proc = ProcessSampler(nvml).sample(time.time())
        # NVML lists this pid with what it holds (or None where the pid namespace hides it:
        # never 0, which would read as "holds nothing").
        assert proc["gpu_mem_bytes"] is None or proc["gpu_mem_bytes"] >= hold.numel(), proc
        print(json.dumps({"gpu_rows": gpus, "process_gpu_mem_bytes": proc["gpu_mem_bytes"]}))
        del hold
    finally:
        nvml.close()


@pytest.mark.skipif(not torch.distributed.is_nccl_available(), reason="needs NCCL")
def test_ddp_allreduce_on_nccl_is_measured_with_device_events(tmp_path: Path) -> None:
    """One rank of NCCL DDP in a child process (one GPU here): every bucket's all-reduce is
    timed on the device by the comm hook, and the gradients are exactly those of DDP with
    the default ``allreduce_hook`` that the timing hook wraps."""
    import torch.multiprocessing as mp

    mp.spawn(_nccl_worker, args=(free_port(), str(tmp_path)), nprocs=1, join=True)
    res = json.loads((tmp_path / "rank0.json").read_text())
    print(json.dumps({k: v for k, v in res.items() if k != "tables"}))
    assert res["parallelism"] == "ddp"
    assert res["max_diff_traced_vs_hooked"] <= 1e-6, res
    rows = _rows(res["tables"]["steps"])
    assert len(rows) == 4
    for r in rows:
        assert r["comm_ns"] is not None and r["comm_ns"] > 0, r
        assert r["wait_ns"] is not None and r["backward_ns"] > 0, r


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def _nccl_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=rank, world_size=1, device_id=torch.device("cuda", 0))
    recorder = Recorder()
    tracer = Tracer(recorder, event_timeout_s=120)
    tracer.install()

    def mlp() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)]).cuda()

    # traced: the agent's timing hook; hooked: the stock allreduce_hook it wraps (the same
    # arithmetic, so the same bits); plain: DDP's built-in reducer (for the record only).
    traced, hooked, plain = (DDP(mlp(), bucket_cap_mb=1) for _ in range(3))
    hooked.register_comm_hook(None, allreduce_hook)
    opts = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (traced, hooked, plain)]
    torch.manual_seed(1)
    for _ in range(4):
        x = torch.randn(64, 512, device="cuda")
        with tracer.trace_step(traced):
            traced(x).pow(2).mean().backward()
            opts[0].step()
        for model, opt in zip((hooked, plain), opts[1:], strict=True):
            model(x).pow(2).mean().backward()
            opt.step()
        for opt in opts:
            opt.zero_grad()
    rows = Rows(tracer, recorder).wait("steps", 4)
    table = {k: [r[k] for r in rows] for k in rows[0]}
    Path(out, "rank0.json").write_text(json.dumps({
        "tables": {"steps": table}, "parallelism": tracer.parallelism(),
        "max_diff_traced_vs_hooked": _max_diff(traced, hooked),
        "max_diff_hooked_vs_plain": _max_diff(hooked, plain),
        "max_diff_traced_vs_plain": _max_diff(traced, plain)}))
    tracer.uninstall()
    dist.destroy_process_group()


# A real runtime (agent.init, its sender thread) traces 3000 short CUDA steps with one
# flush a minute: 30,000 events against a pool of 8192, so only the sender's resolution
# between flushes (sender.RESOLVE_S) keeps every step's device timings.
_FAST_STEPS_SCRIPT = """
import json, time, torch, agent
from agent import runtime
agent.init()
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(32, 64).pin_memory()
t0 = time.perf_counter()
for _ in range(3000):
    with agent.trace_step(model):
        model(x.to("cuda", non_blocking=True)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
torch.cuda.synchronize()
elapsed = time.perf_counter() - t0
counters = runtime.current.tracer.counters()
agent.shutdown()
print(json.dumps({"counters": counters, "steps_per_s": 3000 / elapsed}))
"""


def test_short_steps_keep_their_device_timings_between_flushes() -> None:
    env = base_env(TRACEML_DAEMON=f"127.0.0.1:{free_port()}", TRACEML_RELAY_PORT=str(free_port()),
                   TRACEML_NO_RELAY="1", TRACEML_FLUSH_S="60", TRACEML_SHUTDOWN_S="2")
    done = subprocess.run([sys.executable, "-c", _FAST_STEPS_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    res = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(res))
    counters = res["counters"]
    assert counters["events_exhausted"] == 0, res
    assert counters["device_steps_fallback"] == 0, res
    assert counters["device_steps_dropped"] == 0 and counters["tracer_errors"] == 0, res
