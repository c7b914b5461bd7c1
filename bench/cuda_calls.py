"""Host cost of the CUDA calls the agent can make on the training thread (needs a GPU).

bench/overhead.py --device cuda measures what a traced step costs in all; this
breaks it down by call, so the device path can pick the cheap way to do each
thing: recording a timing event, reading the per-step memory peak, resetting it.
Each figure is the median over ``--rounds`` rounds of the mean time per call
over ``--calls`` calls, printed beside an empty Python call's (the baseline: what
a call costs at all). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def per_call_us(fn: Callable[[], Any], calls: int, rounds: int) -> float:
    means = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        means.append((time.perf_counter_ns() - t0) / calls / 1e3)
    return statistics.median(means)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/cuda_calls.py needs a CUDA device (torch.cuda.is_available() is False)")
    torch.cuda.init()
    dev = torch.cuda.current_device()
    keep = torch.empty(1 << 20, device="cuda")  # the allocator has something to report
    stream = torch.cuda.current_stream()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    for ev in events:
        ev.record()
    torch.cuda.synchronize()
    ev = events[0]
    record_raw = torch._C._CudaEventBase.record
    stats = torch._C._cuda_memoryStats
    reset = torch._C._cuda_resetPeakMemoryStats
    get_device = torch._C._cuda_getDevice

    def empty() -> None:
        return None

    cases: dict[str, Callable[[], Any]] = {
        "empty python call (baseline)": empty,
        "Event.record() (current stream looked up)": ev.record,
        "Event.record(stream) (stream given)": lambda: ev.record(stream),
        "_CudaEventBase.record(ev, stream)": lambda: record_raw(ev, stream),
        "torch.cuda.current_stream()": torch.cuda.current_stream,
        "torch.cuda.current_device()": torch.cuda.current_device,
        "torch._C._cuda_getDevice()": get_device,
        "Event.query() (completed)": ev.query,
        "Event.elapsed_time()": lambda: events[0].elapsed_time(events[1]),
        "torch.cuda.max_memory_allocated()": torch.cuda.max_memory_allocated,
        "torch.cuda.memory_reserved()": torch.cuda.memory_reserved,
        "torch.cuda.reset_peak_memory_stats()": torch.cuda.reset_peak_memory_stats,
        "torch._C._cuda_memoryStats(dev) (nested dict, one read)": lambda: stats(dev),
        "_cuda_memoryStats + peak and reserved lookups": lambda: (
            (s := stats(get_device()))["allocated_bytes"]["all"]["peak"], s["reserved_bytes"]["all"]["current"]),
        "torch._C._cuda_resetPeakMemoryStats(dev)": lambda: reset(get_device()),
    }
    results: dict[str, float] = {}
    for name, fn in cases.items():
        fn()
        results[name] = per_call_us(fn, args.calls, args.rounds)
        base = results["empty python call (baseline)"]
        print(f"{results[name]:9.2f} us/call  ({results[name] - base:+8.2f} over the baseline)  {name}", flush=True)
        torch.cuda.synchronize()
    del keep
    print(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "us_per_call": results}))


if __name__ == "__main__":
    main()
