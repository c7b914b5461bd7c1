"""Numerics fingerprints on a real GPU: the norms are queued on the device and read back
without a synchronisation, and once read they equal torch's float32 norms (to rounding: another
kernel) and the parameters' bit sums exactly.

Skipped where there is no CUDA device (run on a GPU machine with ``bench/cuda_check.sh``
or pytest directly); ``tests/agent/test_fingerprint.py`` runs the host path everywhere.
"""

from __future__ import annotations

import pytest
import torch

from agent.capture.events import CudaEventBackend
from agent.fingerprint import bit_sum
from agent.recorder import Recorder
from agent.tracer import Tracer
from tests.agent.test_cuda_real import GpuBusy, Rows, _sleep_cycles_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_fingerprints_never_wait_for_the_gpu_and_match_torch() -> None:
    recorder = Recorder()
    tracer = Tracer(recorder, event_timeout_s=120, fingerprint_every=1)
    tracer.install()
    try:
        assert isinstance(tracer._backend, CudaEventBackend)
        model = GpuBusy(0).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(64, 256, device="cuda")
        model(x).pow(2).mean().backward()  # warm-up outside the traced steps (cuBLAS, autograd's thread)
        opt.step()
        cycles, _ = _sleep_cycles_for(100.0)
        model.cycles = cycles
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any synchronizing call on this thread raises
        try:
            for step in range(3):
                with tracer.trace_step(model):
                    opt.zero_grad(set_to_none=True)
                    model(x).pow(2).mean().backward()
                    if step == 1:
                        model.fc.weight.grad.view(-1)[5] = float("inf")  # type: ignore[union-attr]
                    opt.step()
                    if step == 1:
                        with torch.no_grad():  # keep the weight finite: only step 1's gradient is not
                            model.fc.weight.view(-1)[5] = 0.0
            behind = torch.cuda.Event()
            behind.record()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert not behind.query(), "the training thread waited for the GPU"
        out = Rows(tracer, recorder)
        rows = out.wait("fingerprints", 3 * 2)
        assert [r["step"] for r in rows] == [0, 0, 1, 1, 2, 2]
        assert [r["layer"] for r in rows[:2]] == ["fc.weight", "fc.bias"]
        assert [r["grad_nonfinite"] for r in rows] == [0, 0, 1, 0, 0, 0]
        last = {r["layer"]: r for r in rows[4:]}
        for name, p in model.named_parameters():
            assert last[name]["param_norm"] == pytest.approx(torch.linalg.vector_norm(p.detach()).item(), rel=1e-5)
            assert last[name]["param_sum"] == int(bit_sum(p.detach()))
        assert tracer.counters()["fingerprints_dropped"] == 0
    finally:
        tracer.uninstall()
