"""agent/samplers.py: a metric that cannot be read is None, never 0.

NVML cannot load on this machine (no driver), so the GPU paths run against a
stand-in ``pynvml`` module put in ``sys.modules``; it raises the real
library's ``NVMLError`` subclasses, as the real bindings do for a metric a
board does not support. Host and process readings come from the real psutil.
"""

from __future__ import annotations

import os
import sys
import time
import types
from collections import namedtuple
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil
import pynvml as real_pynvml
import pytest

from agent import samplers
from agent.samplers import GpuSampler, Nvml, ProcessSampler, SystemSampler


def _not_supported(*_: Any) -> Any:
    raise real_pynvml.NVMLError(real_pynvml.NVML_ERROR_NOT_SUPPORTED)


@dataclass
class FakeBoard:
    """One GPU as the stand-in reports it; a reader set to None raises NVMLError."""

    util: int | None = 40
    used: int | None = 3 << 30
    total: int = 16 << 30
    temp: int | None = 61
    power_mw: int | None = 123_000
    procs: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, usedGpuMemory)
    procs_fail: bool = False


def fake_pynvml(boards: list[FakeBoard], init_fails: bool = False) -> types.ModuleType:
    """A module with the pynvml calls samplers.py makes, reading ``boards``."""
    mod = types.ModuleType("pynvml")
    mod.NVMLError = real_pynvml.NVMLError  # type: ignore[attr-defined]
    mod.NVML_TEMPERATURE_GPU = real_pynvml.NVML_TEMPERATURE_GPU  # type: ignore[attr-defined]
    calls: list[str] = []
    mod.calls = calls  # type: ignore[attr-defined]

    def init() -> None:
        calls.append("init")
        if init_fails:
            raise real_pynvml.NVMLError(real_pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    def reader(attr: str, build: Callable[[Any], Any]) -> Callable[..., Any]:
        def read(handle: FakeBoard, *_: Any) -> Any:
            value = getattr(handle, attr)
            return _not_supported() if value is None else build(value)

        return read

    def running(handle: FakeBoard) -> list[Any]:
        if handle.procs_fail:
            _not_supported()
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in handle.procs]

    mod.nvmlInit = init  # type: ignore[attr-defined]
    mod.nvmlShutdown = lambda: calls.append("shutdown")  # type: ignore[attr-defined]
    mod.nvmlDeviceGetCount = lambda: len(boards)  # type: ignore[attr-defined]
    mod.nvmlDeviceGetHandleByIndex = lambda i: boards[i]  # type: ignore[attr-defined]
    mod.nvmlDeviceGetUtilizationRates = reader("util", lambda v: types.SimpleNamespace(gpu=v, memory=0))  # type: ignore[attr-defined]
    mod.nvmlDeviceGetTemperature = reader("temp", lambda v: v)  # type: ignore[attr-defined]
    mod.nvmlDeviceGetPowerUsage = reader("power_mw", lambda v: v)  # type: ignore[attr-defined]
    mod.nvmlDeviceGetComputeRunningProcesses = running  # type: ignore[attr-defined]

    def memory(handle: FakeBoard) -> Any:
        if handle.used is None:
            _not_supported()
        return types.SimpleNamespace(used=handle.used, total=handle.total, free=handle.total - handle.used)

    mod.nvmlDeviceGetMemoryInfo = memory  # type: ignore[attr-defined]
    return mod


@pytest.fixture
def install_nvml(monkeypatch: pytest.MonkeyPatch) -> Callable[..., types.ModuleType]:
    def install(boards: list[FakeBoard], init_fails: bool = False) -> types.ModuleType:
        mod = fake_pynvml(boards, init_fails)
        monkeypatch.setitem(sys.modules, "pynvml", mod)
        return mod

    return install


# ------------------------------------------------------------------ NVML


def test_nvml_on_this_machine_is_absent_not_zero() -> None:
    """The real library without a driver: no GPU rows and no per-process GPU memory.
    (Where a driver is present, tests/agent/test_cuda_real.py reads the real GPU.)"""
    nvml = Nvml()
    if nvml.ok:
        nvml.close()
        pytest.skip("NVML loads here: a GPU machine (see test_cuda_real.py)")
    assert nvml.ok is False
    assert GpuSampler(nvml).sample(time.time()) == []
    assert nvml.process_memory(os.getpid()) is None
    assert ProcessSampler(nvml).sample(time.time())["gpu_mem_bytes"] is None


def test_nvml_init_error_means_no_gpu_rows(install_nvml: Callable[..., types.ModuleType]) -> None:
    mod = install_nvml([FakeBoard()], init_fails=True)
    nvml = Nvml()
    assert mod.calls == ["init"]
    assert nvml.ok is False and nvml.handles == []
    assert GpuSampler(nvml).sample(1.0) == []
    nvml.close()
    assert "shutdown" not in mod.calls  # never initialized, so nothing to shut down


def test_unreadable_temperature_and_power_are_none(install_nvml: Callable[..., types.ModuleType]) -> None:
    install_nvml([FakeBoard(temp=None, power_mw=None), FakeBoard(util=0, temp=35, power_mw=0)])
    nvml = Nvml()
    assert nvml.ok
    rows = GpuSampler(nvml).sample(5.0)
    assert [r["gpu_index"] for r in rows] == [0, 1]
    first, second = rows
    assert first["temp_c"] is None and first["power_w"] is None
    # The readable metrics of the same board are still there.
    assert first["util_pct"] == 40.0 and first["mem_used_bytes"] == 3 << 30 and first["mem_total_bytes"] == 16 << 30
    # A real zero stays a zero: None is only for "could not read".
    assert second["util_pct"] == 0.0 and second["power_w"] == 0.0 and second["temp_c"] == 35.0
    assert first["ts"] == second["ts"] == 5.0


def test_unreadable_utilization_and_memory_are_none(install_nvml: Callable[..., types.ModuleType]) -> None:
    install_nvml([FakeBoard(util=None, used=None)])
    (row,) = GpuSampler(Nvml()).sample(1.0)
    assert row["util_pct"] is None
    assert row["mem_used_bytes"] is None and row["mem_total_bytes"] is None
    assert row["temp_c"] == 61.0 and row["power_w"] == 123.0


def test_process_gpu_memory_sums_boards_and_is_none_when_not_listed(
    install_nvml: Callable[..., types.ModuleType],
) -> None:
    me = os.getpid()
    boards = [FakeBoard(procs=[(me, 1 << 20), (me + 1, 5 << 20)]), FakeBoard(procs=[(me, 2 << 20)])]
    install_nvml(boards)
    nvml = Nvml()
    assert nvml.process_memory(me) == 3 << 20
    # Not listed anywhere (another pid namespace, say): unknown, not "0 bytes".
    assert nvml.process_memory(me + 2) is None
    # NVML's "not available" for usedGpuMemory is None in the bindings.
    boards[0].procs, boards[1].procs = [(me, None)], []
    assert nvml.process_memory(me) is None
    # The process list itself cannot be read on one board: the other still counts.
    boards[0].procs_fail, boards[1].procs = True, [(me, 7 << 20)]
    assert nvml.process_memory(me) == 7 << 20
    boards[1].procs_fail = True
    assert nvml.process_memory(me) is None


def test_process_sampler_reads_gpu_memory_through_nvml(install_nvml: Callable[..., types.ModuleType]) -> None:
    mod = install_nvml([FakeBoard(procs=[(os.getpid(), 9 << 20)])])
    nvml = Nvml()
    assert ProcessSampler(nvml).sample(1.0)["gpu_mem_bytes"] == 9 << 20
    nvml.close()
    assert mod.calls == ["init", "shutdown"]
    assert nvml.ok is False
    assert nvml.process_memory(os.getpid()) is None  # closed: no stale readings


# ------------------------------------------------------------------ process


def _burn_cpu(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_process_sampler_first_cpu_is_none_then_real_numbers() -> None:
    sampler = ProcessSampler(None)
    first = sampler.sample(10.0)
    # psutil's first cpu_percent() has nothing to compare with and says 0.0.
    assert first["cpu_pct"] is None
    assert first["ts"] == 10.0
    assert isinstance(first["rss_bytes"], int) and first["rss_bytes"] > 0
    assert isinstance(first["threads"], int) and first["threads"] >= 1
    assert first["gpu_mem_bytes"] is None  # no NVML given
    _burn_cpu(0.05)
    second = sampler.sample(11.0)
    assert isinstance(second["cpu_pct"], float)
    assert second["cpu_pct"] > 0  # this process just burnt CPU time
    assert second["rss_bytes"] == pytest.approx(psutil.Process().memory_info().rss, rel=0.5)


def test_process_metric_that_raises_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    sampler = ProcessSampler(None)
    sampler.sample(1.0)

    def denied(*_: Any, **__: Any) -> Any:
        raise psutil.AccessDenied(os.getpid())

    monkeypatch.setattr(psutil.Process, "memory_info", denied)
    monkeypatch.setattr(psutil.Process, "cpu_percent", denied)
    row = sampler.sample(2.0)
    assert row["rss_bytes"] is None
    assert row["cpu_pct"] is None
    assert isinstance(row["threads"], int)  # the others are unaffected


# ------------------------------------------------------------------ system


def test_system_sampler_first_reading_has_no_rates_then_real_numbers() -> None:
    sampler = SystemSampler()
    first = sampler.sample(1.0)
    assert first["cpu_pct"] is None
    for key in ("net_rx_bps", "net_tx_bps", "disk_read_bps", "disk_write_bps"):
        assert first[key] is None, key
    mem = psutil.virtual_memory()
    assert first["mem_total_bytes"] == mem.total
    assert isinstance(first["mem_used_bytes"], int) and 0 < first["mem_used_bytes"] <= mem.total

    _burn_cpu(0.05)
    second = sampler.sample(2.0)
    assert isinstance(second["cpu_pct"], float) and 0.0 <= second["cpu_pct"] <= 100.0
    for key in ("net_rx_bps", "net_tx_bps"):
        assert isinstance(second[key], float) and second[key] >= 0, key
    # Some containers expose no block devices: then the rate is unknown, not 0.
    disk_readable = psutil.disk_io_counters() is not None
    for key in ("disk_read_bps", "disk_write_bps"):
        if disk_readable:
            assert isinstance(second[key], float) and second[key] >= 0, key
        else:
            assert second[key] is None, key


Net = namedtuple("Net", "bytes_sent bytes_recv")
Disk = namedtuple("Disk", "read_bytes write_bytes")


@pytest.fixture
def scripted_host(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, list[Any]]]:
    """psutil's host counters and the sampler's clock replaced by scripted sequences."""
    script: dict[str, list[Any]] = {"clock": [], "net": [], "disk": []}

    def pop(name: str) -> Callable[..., Any]:
        def read(*_: Any, **__: Any) -> Any:
            value = script[name].pop(0)
            if isinstance(value, Exception):
                raise value
            return value

        return read

    monkeypatch.setattr(samplers, "time", types.SimpleNamespace(monotonic=pop("clock")))
    monkeypatch.setattr(psutil, "net_io_counters", pop("net"))
    monkeypatch.setattr(psutil, "disk_io_counters", pop("disk"))
    yield script
    assert all(not left for left in script.values()), script  # every scripted reading was taken


def test_counter_going_backwards_gives_none_not_a_negative_or_zero_rate(
    scripted_host: dict[str, list[Any]],
) -> None:
    scripted_host["clock"] += [100.0, 102.0, 104.0]
    scripted_host["net"] += [Net(1000, 5000), Net(3000, 100), Net(5000, 2100)]
    scripted_host["disk"] += [Disk(0, 800), Disk(4096, 400), Disk(8192, 600)]
    sampler = SystemSampler()
    sampler.sample(1.0)
    row = sampler.sample(2.0)
    assert row["net_tx_bps"] == 1000.0  # (3000 - 1000) bytes / 2 s
    assert row["net_rx_bps"] is None  # 5000 -> 100: the interface was reset
    assert row["disk_read_bps"] == 2048.0
    assert row["disk_write_bps"] is None  # 800 -> 400
    # After the reset, the new counter is the baseline again.
    row = sampler.sample(3.0)
    assert row["net_rx_bps"] == 1000.0 and row["net_tx_bps"] == 1000.0
    assert row["disk_read_bps"] == 2048.0 and row["disk_write_bps"] == 100.0


def test_unreadable_host_counters_give_none_rates(scripted_host: dict[str, list[Any]]) -> None:
    scripted_host["clock"] += [10.0, 11.0, 12.0]
    # disk_io_counters() returns None without block devices; net may fail outright.
    scripted_host["net"] += [Net(0, 0), OSError("no /proc/net/dev"), Net(10, 10)]
    scripted_host["disk"] += [None, None, Disk(0, 0)]
    sampler = SystemSampler()
    sampler.sample(1.0)
    row = sampler.sample(2.0)
    for key in ("net_rx_bps", "net_tx_bps", "disk_read_bps", "disk_write_bps"):
        assert row[key] is None, key
    # A reading after an unreadable one has no baseline: still None, not a rate over a gap.
    row = sampler.sample(3.0)
    for key in ("net_rx_bps", "net_tx_bps", "disk_read_bps", "disk_write_bps"):
        assert row[key] is None, key


def test_unreadable_memory_and_cpu_are_none(monkeypatch: pytest.MonkeyPatch) -> None:
    sampler = SystemSampler()
    sampler.sample(1.0)

    def broken(*_: Any, **__: Any) -> Any:
        raise OSError("no /proc/meminfo")

    monkeypatch.setattr(psutil, "virtual_memory", broken)
    monkeypatch.setattr(psutil, "cpu_percent", broken)
    row = sampler.sample(2.0)
    assert row["mem_used_bytes"] is None and row["mem_total_bytes"] is None
    assert row["cpu_pct"] is None
