"""Process, host and GPU samplers, run on the sender thread once per flush.

Each sampler returns rows for one wire table (traceml_wire.tables). A metric
that cannot be read is None, never 0: zero would read as "idle GPU" or "no
memory" in the diagnosis. Rates need two samples, so the first one is None.
NVML is optional: when the library does not load there are no GPU rows and
per-process GPU memory is None.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import psutil

Row = dict[str, Any]


def _safe(read: Callable[[], Any]) -> Any:
    """One metric; any failure (unsupported, permission, driver hiccup) is None."""
    try:
        return read()
    except Exception:
        return None


class Nvml:
    """Lazily initialized NVML; ``ok`` is False when the library is absent."""

    def __init__(self) -> None:
        self.ok = False
        self._lib: Any = None
        self._handles: list[Any] = []
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self._lib = pynvml
            self.ok = True
        except Exception:  # no driver, no GPU, no library: a CPU run
            self.ok = False

    @property
    def handles(self) -> list[Any]:
        return self._handles

    @property
    def lib(self) -> Any:
        return self._lib

    def close(self) -> None:
        if self.ok:
            _safe(self._lib.nvmlShutdown)
            self.ok = False

    def process_memory(self, pid: int) -> int | None:
        """GPU memory this pid holds across all GPUs, or None if not visible.

        A pid NVML does not list gives None rather than 0: in containers the
        pid namespace differs and "0 bytes" would be a lie.
        """
        if not self.ok:
            return None
        total: int | None = None
        for handle in self._handles:
            procs = _safe(lambda h=handle: self._lib.nvmlDeviceGetComputeRunningProcesses(h)) or []
            for proc in procs:
                used = getattr(proc, "usedGpuMemory", None)
                if getattr(proc, "pid", None) == pid and isinstance(used, int):
                    total = (total or 0) + used
        return total


class ProcessSampler:
    """This process: CPU %, RSS, threads, GPU memory (every rank)."""

    def __init__(self, nvml: Nvml | None) -> None:
        self._nvml = nvml
        self._pid = os.getpid()
        self._proc = psutil.Process(self._pid)
        self._primed = False

    def sample(self, now: float) -> Row:
        cpu = _safe(lambda: self._proc.cpu_percent(interval=None))
        # psutil's first cpu_percent() has no previous reading and returns 0.0.
        if not self._primed:
            cpu, self._primed = None, True
        return {
            "ts": now,
            "cpu_pct": cpu,
            "rss_bytes": _safe(lambda: self._proc.memory_info().rss),
            "gpu_mem_bytes": self._nvml.process_memory(self._pid) if self._nvml else None,
            "threads": _safe(self._proc.num_threads),
        }


class SystemSampler:
    """The host: CPU %, memory, network and disk rates (local rank 0 only)."""

    def __init__(self) -> None:
        self._last: tuple[float, Any, Any] | None = None
        _safe(lambda: psutil.cpu_percent(interval=None))  # prime the CPU counter

    def sample(self, now: float) -> Row:
        mem = _safe(psutil.virtual_memory)
        net = _safe(psutil.net_io_counters)
        disk = _safe(psutil.disk_io_counters)
        row: Row = {
            "ts": now,
            "cpu_pct": _safe(lambda: psutil.cpu_percent(interval=None)) if self._last else None,
            "mem_used_bytes": getattr(mem, "used", None),
            "mem_total_bytes": getattr(mem, "total", None),
            "net_rx_bps": None,
            "net_tx_bps": None,
            "disk_read_bps": None,
            "disk_write_bps": None,
        }
        mono = time.monotonic()
        if self._last is not None:
            then, last_net, last_disk = self._last
            dt = mono - then
            if dt > 0:
                row["net_rx_bps"] = _rate(net, last_net, "bytes_recv", dt)
                row["net_tx_bps"] = _rate(net, last_net, "bytes_sent", dt)
                row["disk_read_bps"] = _rate(disk, last_disk, "read_bytes", dt)
                row["disk_write_bps"] = _rate(disk, last_disk, "write_bytes", dt)
        self._last = (mono, net, disk)
        return row


def _rate(now: Any, then: Any, attr: str, dt: float) -> float | None:
    a, b = getattr(now, attr, None), getattr(then, attr, None)
    if a is None or b is None or a < b:  # counter reset (interface down/up)
        return None
    return (a - b) / dt


class GpuSampler:
    """Every GPU on the host through NVML (local rank 0 only)."""

    def __init__(self, nvml: Nvml) -> None:
        self._nvml = nvml

    def sample(self, now: float) -> list[Row]:
        if not self._nvml.ok:
            return []
        lib = self._nvml.lib
        rows: list[Row] = []
        for index, handle in enumerate(self._nvml.handles):
            util = _safe(lambda h=handle: lib.nvmlDeviceGetUtilizationRates(h))
            mem = _safe(lambda h=handle: lib.nvmlDeviceGetMemoryInfo(h))
            temp = _safe(lambda h=handle: lib.nvmlDeviceGetTemperature(h, lib.NVML_TEMPERATURE_GPU))
            power_mw = _safe(lambda h=handle: lib.nvmlDeviceGetPowerUsage(h))
            rows.append(
                {
                    "ts": now,
                    "gpu_index": index,
                    "util_pct": float(util.gpu) if util is not None else None,
                    "mem_used_bytes": getattr(mem, "used", None),
                    "mem_total_bytes": getattr(mem, "total", None),
                    "temp_c": float(temp) if temp is not None else None,
                    "power_w": power_mw / 1000.0 if power_mw is not None else None,
                }
            )
        return rows
