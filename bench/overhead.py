"""Training-thread cost of ``agent.trace_step`` + automatic phase capture (CPU).

Modes run interleaved block by block in one process, so a noisy machine hits
all of them alike:

* ``none``: no instrumentation (the baseline every cost is taken against);
* ``none_aa``: the same bare step in blocks of its own, the A/A control: its
  true cost is zero, so its figure is the measurement's own noise;
* ``null``: the control for the entry points (``NullInstrumentation``): the
  agent's mechanisms (call wrapper on the root module, backward wrapper,
  optimizer hooks, DataLoader patch, step context), each doing nothing;
  ``null_hooks``: the same with the agent's former root forward hooks;
  ``null_fwd_wrap`` / ``null_fwd_hooks``: the forward mechanism alone;
* ``tracer``: an installed Tracer called directly, deep dive off (one per
  configuration, installed for its blocks only, polled between blocks);
  ``tracer_ref`` (``--reference``): another build's Tracer, e.g. the last
  commit's, for a before/after comparison in the same run;
* ``public``: the user's path, ``agent.init()`` once, then ``with
  agent.trace_step(model)``; no daemon or relay listens (a job whose daemon
  is down); the runtime's tracer is installed during ``public`` blocks only,
  its sender thread runs throughout, for every mode alike;
* ``profiler``: torch.profiler, CPU activity (fewer rounds and steps).

A step is a real forward/backward/SGD step of a Sequential of N modules with
one DataLoader fetch, padded to the target step time with a FIXED spin: the
loop count is calibrated once per configuration on the uninstrumented step
and then reused unchanged by every mode. (Padding with ``spin_until(t0 +
target)`` would let the spin absorb the tracer's own cost.)

Every step is timed on two clocks: the training thread's CPU time (the
figure: what the agent costs that thread, without the time it sat
descheduled on a shared machine) and wall time. Figures, each beside the
baseline it is taken against:

* per configuration and mode: median step with the mode - median step of
  ``none``; the paired figure, the median of the per-round differences, with
  a bootstrap 95% interval over rounds and the min..max of the rounds; a
  figure whose interval holds 0 is marked WITHIN NOISE;
* (a) those at the shortest step for every model size, and the spread from
  the smallest to the largest model (its own interval);
* (b) the relative cost at the ~20 ms step, measured there, and the
  short-step cost divided by the 20 ms step;
* (c) the agent's work per traced step, counted rather than timed: the
  bytecodes and Python calls it executes at each model size (equal counts:
  no per-module work, so timed growth is the same code running colder);
* launch cost: ``python -c 'import agent; agent.init()'`` against
  ``python -c 'import torch'`` (the issue's pair; init() imports no torch),
  ``python -c 'import torch; import agent; agent.init()'`` against the same
  baseline (what a training script pays), and ``agent.init()`` alone, with
  no daemon.

Between processes the figures move by a few microseconds more than one run's
intervals say (memory layout: where code and objects land in the caches is
fixed for a process's lifetime), so compare runs, not only rounds. Ends with
one JSON line. ``--long`` runs more rounds; ``--quick`` fewer.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
import weakref
import zlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from itertools import repeat
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

# The agent of the checkout this file is in, not whichever one is installed: from a
# worktree the editable install pointed at the main checkout, so the bench timed that
# agent and (c) counted 0 bytecodes (the executed files lay outside AGENT_DIR).
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import agent  # noqa: E402
from agent.recorder import Recorder  # noqa: E402
from agent.tracer import Tracer  # noqa: E402

MODES_ALL = ("none", "none_aa", "null", "null_hooks", "null_fwd_wrap", "null_fwd_hooks", "tracer_ref", "tracer", "public", "profiler")
TraceFn = Callable[[torch.nn.Module], AbstractContextManager[Any]]


def _layer(i: int) -> torch.nn.Module:
    # Mostly Identity so that even 512 modules make a step of a few ms (a deep model of
    # real layers would drown a microsecond-scale cost in its own noise); every 8th is a
    # Linear, so parameters, gradients and the optimizer grow with depth as well.
    if i % 8 == 0:
        return torch.nn.Linear(8, 8)
    if i % 8 == 4:
        return torch.nn.Tanh()
    return torch.nn.Identity()


class _Evict(torch.autograd.Function):
    """Walks a big list in forward and in backward: leaves the caches cold for what follows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, junk: list[int]) -> torch.Tensor:
        ctx.junk = junk
        sum(junk)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        sum(ctx.junk)
        return grad, None


class Evict(torch.nn.Module):
    """The cold-cache control (``--evict-mb``): a module whose forward and backward each
    touch ``mb`` MiB of Python objects, as a big model's forward and backward would, while
    the number of modules (and of parameters) stays that of the small model. Evicted
    there, the agent's forward post and backward end run cold, and so do step exit, the
    next DataLoader fetch and step enter after the padding's own walk (Workload.evict)."""

    def __init__(self, mb: float) -> None:
        super().__init__()
        # A list of distinct ints: 8 bytes of pointer + 32 of int object each.
        self.junk = list(range(1 << 20, (1 << 20) + int(mb * (1 << 20) / 40)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _Evict.apply(x, self.junk)
        return out


def make_model(n_modules: int, evict_mb: float = 0.0) -> torch.nn.Module:
    # n_modules counts every module including the Sequential itself (and the Evict module).
    if evict_mb > 0:
        return torch.nn.Sequential(Evict(evict_mb), *[_layer(i) for i in range(n_modules - 2)])
    return torch.nn.Sequential(*[_layer(i) for i in range(n_modules - 1)])


class _QuietStderr:
    """torch.profiler's native layer prints start/stop lines on fd 2: keep the report readable."""

    def __enter__(self) -> None:
        sys.stderr.flush()
        self._saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)

    def __exit__(self, *exc: object) -> None:
        os.dup2(self._saved, 2)
        os.close(self._saved)


def spin(iterations: int) -> int:
    """A fixed amount of pure-Python work whose cost does not depend on what ran before.

    Allocation-free: ``repeat`` yields one object and ``acc`` stays a cached small int.
    The former loop (``acc ^= i`` over ``range``) allocated two ints an iteration, so its
    speed followed the allocator's state, which the modes change (records a tracer holds
    until poll): at the 20 ms step, all pad, traced blocks ran 2-4% faster than ``none``.
    """
    acc = 0
    for _ in repeat(None, iterations):
        acc ^= 1
    return acc


def calibrate_spin() -> float:
    """Spin iterations per nanosecond (median of a few tries, done once)."""
    rates = []
    for _ in range(7):
        n = 200_000
        t0 = time.perf_counter_ns()
        spin(n)
        rates.append(n / max(1, time.perf_counter_ns() - t0))
    return statistics.median(rates)


# --device cuda: the model lives on the GPU, each batch is copied there inside the step
# (pinned, non_blocking), and the tracers time phases with CUDA events.
DEVICE = torch.device("cpu")


class Workload:
    """One model + optimizer + endless loader; ``step`` runs one padded step."""

    def __init__(self, n_modules: int, evict_mb: float = 0.0) -> None:
        self.model = make_model(n_modules, evict_mb).to(DEVICE)
        first = self.model[0] if len(self.model) else None
        self.evict: list[int] | None = first.junk if isinstance(first, Evict) else None
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.loader = DataLoader(TensorDataset(torch.randn(4096, 8)), batch_size=4,
                                 pin_memory=DEVICE.type == "cuda")
        self._it: Iterator[Any] = iter(self.loader)
        self.pad = 0
        self.tracers: dict[str, Any] = {}

    def _next(self) -> torch.Tensor:
        try:
            (x,) = next(self._it)
        except StopIteration:
            self._it = iter(self.loader)
            (x,) = next(self._it)
        return x

    def _body(self, x: torch.Tensor) -> None:
        if DEVICE.type == "cuda":
            x = x.to(DEVICE, non_blocking=True)
        self.model(x).sum().backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        spin(self.pad)
        if self.evict is not None:
            sum(self.evict)  # cold again for step exit, the next fetch and step enter

    def run(self, steps: int, trace: TraceFn | None) -> tuple[list[int], list[int]]:
        """(wall ns, training-thread CPU ns) per step.

        Both clocks are read around every step in every mode, so their own cost cancels
        in the differences. CPU time leaves out the time this thread sat descheduled
        (the machine is shared), which is most of the wall-clock noise; the cache misses
        a preemption causes stay in both.
        """
        perf = time.perf_counter_ns
        cpu = time.thread_time_ns
        model = self.model
        walls: list[int] = []
        cpus: list[int] = []
        for _ in range(steps):
            c0 = cpu()
            t0 = perf()
            x = self._next()
            if trace is not None:
                with trace(model):
                    self._body(x)
            else:
                self._body(x)
            t1 = perf()
            c1 = cpu()
            walls.append(t1 - t0)
            cpus.append(c1 - c0)
        return walls, cpus


def start_public() -> None:
    """``agent.init()`` as a training script calls it, with no daemon and no relay.

    The ports are unused ones (this run must not talk to a daemon another job
    started) and the in-process relay is off; the sender thread retries in the
    background like it would for a job whose daemon is down. The runtime's
    tracer is then uninstalled until a ``public`` block needs it.
    """
    os.environ["TRACEML_DAEMON"] = f"127.0.0.1:{_free_port()}"
    os.environ["TRACEML_RELAY_PORT"] = str(_free_port())
    os.environ["TRACEML_NO_RELAY"] = "1"
    for var in ("TRACEML_DISABLE", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        os.environ.pop(var, None)
    agent.init()
    _public_tracer().uninstall()


def _public_tracer() -> Any:
    from agent import runtime

    rt = runtime.current
    if rt is None or rt.tracer is None:
        raise RuntimeError("agent.init() did not start a tracer")
    return rt.tracer


class _NullStep:
    """An empty step context manager: the cost of the ``with`` statement and nothing else."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


class NullInstrumentation:
    """The control: the tracer's entry points, each doing nothing.

    Same mechanisms and registration as the agent: the root module's call wrapped by a
    pass-through ``_call_impl`` in its instance dict (mode ``null``; ``null_hooks``: the
    agent's former root forward pre-hook with ``prepend`` and post-hook with
    ``always_call``), a pass-through ``torch.autograd.backward`` wrapper, global optimizer
    step pre/post hooks, a pass-through DataLoader ``__next__`` patch and a context
    manager around the step. The difference to ``none`` is what CPython and torch charge
    for the entry points alone; whatever the tracer costs beyond it is its own work. If
    this grows with the module count as the tracer does, the growth is in the dispatch
    (a bigger step leaves the same code colder), not in anything the agent does per
    module. ``null_fwd_wrap`` / ``null_fwd_hooks`` keep the forward mechanism alone.
    """

    def __init__(self, forward_only: bool = False, forward_wrapper: bool = False) -> None:
        self.forward_only = forward_only
        self.forward_wrapper = forward_wrapper
        self._undo: list[Callable[[], None]] = []
        self._ctx = _NullStep()

    def install(self, model: torch.nn.Module) -> None:
        def pre(module: torch.nn.Module, args: Any) -> None:
            return None

        def post(module: torch.nn.Module, args: Any, output: Any) -> None:
            return None

        if self.forward_wrapper:
            # The tracer's default mechanism (agent.capture.model.TimedCall): a pass-through
            # _call_impl in the instance dict, so torch's own _call_impl keeps its fast path.
            ref = weakref.ref(model)
            call_impl = type(model)._call_impl

            class _Call:
                __slots__ = ()

                def __call__(self, *args: Any, **kwargs: Any) -> Any:
                    return call_impl(ref(), *args, **kwargs)

            model.__dict__["_call_impl"] = _Call()
            self._undo.append(lambda: model.__dict__.pop("_call_impl", None) and None)
        else:
            handles = [model.register_forward_pre_hook(pre, prepend=True),
                       model.register_forward_hook(post, always_call=True)]
            self._undo.append(lambda: [h.remove() for h in handles] and None)
        if self.forward_only:
            return
        import torch.autograd
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        from torch.utils.data.dataloader import _BaseDataLoaderIter

        orig_backward = torch.autograd.backward

        def backward(*args: Any, **kwargs: Any) -> Any:
            return orig_backward(*args, **kwargs)

        torch.autograd.backward = backward  # type: ignore[assignment]
        self._undo.append(lambda: setattr(torch.autograd, "backward", orig_backward))

        def opt_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
            return None

        opt_handles = [register_optimizer_step_pre_hook(opt_hook), register_optimizer_step_post_hook(opt_hook)]
        self._undo.append(lambda: [h.remove() for h in opt_handles] and None)
        orig_next = _BaseDataLoaderIter.__next__

        def __next__(self: Any) -> Any:
            return orig_next(self)

        _BaseDataLoaderIter.__next__ = __next__  # type: ignore[method-assign]
        self._undo.append(lambda: setattr(_BaseDataLoaderIter, "__next__", orig_next))

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def trace_step(self, model: torch.nn.Module) -> _NullStep:
        return self._ctx


# --reference: another build's Tracer class, run as mode "tracer_ref" beside this one (a
# before/after comparison in one interleaved run).
REFERENCE_TRACER: list[Any] = []


def run_block(mode: str, work: Workload, steps: int, recorder: Recorder,
              warmup: int = 2) -> tuple[list[int], list[int]]:
    """One block of ``steps`` timed steps in ``mode``; set-up and warm-up steps are not timed."""
    tracer: Any = None
    trace: TraceFn | None = None
    prof: Any = None
    if mode.startswith("null"):
        tracer = NullInstrumentation(forward_only=mode.startswith("null_fwd"),
                                     forward_wrapper=not mode.endswith("hooks"))
        tracer.install(work.model)
        trace = tracer.trace_step
    elif mode in ("tracer", "tracer_ref"):
        # One Tracer per configuration, installed for its blocks only (like the runtime's in
        # public mode): what lives across steps in real use (recycled step records, the
        # model's state) lives across blocks here too.
        tracer = work.tracers.get(mode)
        if tracer is None:
            factory = Tracer if mode == "tracer" else REFERENCE_TRACER[0]
            # On CUDA each build picks its own backend (its default_backend()), so that
            # tracer_ref measures the reference's device path, not this one's.
            kwargs = {} if DEVICE.type == "cuda" else {"event_backend": None}
            tracer = work.tracers[mode] = factory(recorder, **kwargs)
        tracer.install()
        trace = tracer.trace_step
    elif mode == "public":
        tracer = _public_tracer()
        tracer.install()
        trace = agent.trace_step
    elif mode == "profiler":
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        with _QuietStderr():
            prof.__enter__()
    # "none" and "none_aa" (the A/A control: the same uninstrumented step in its own
    # blocks) run bare.
    try:
        # The first traced step describes the model and registers its hooks (once per model).
        work.run(warmup, trace)
        return work.run(steps, trace)
    finally:
        if tracer is not None:
            tracer.uninstall()
            if mode in ("tracer", "tracer_ref"):
                tracer.poll()  # rows are built here, on the sender thread in real use: not timed
        if prof is not None:
            with _QuietStderr():
                prof.__exit__(None, None, None)
        recorder.drain()  # the sender thread's job: not on the timed path


# torch.profiler's stop processes every recorded op (seconds for deep models): it runs in
# this many rounds only, with short blocks. Its cost is 10-100x the others', so its
# figure needs far fewer samples to stand out of the noise.
PROFILER_ROUNDS = 3
PROFILER_MAX_STEPS = 40


def _bootstrap_median(deltas: list[float], seed: int, n: int = 2000) -> list[float]:
    """Medians of ``n`` resamples (with replacement) of the per-round differences."""
    rng = random.Random(seed)
    k = len(deltas)
    return [statistics.median(rng.choices(deltas, k=k)) for _ in range(n)]


def _quantiles95(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return ordered[int(0.025 * (len(ordered) - 1))], ordered[int(0.975 * (len(ordered) - 1))]


def _summary(deltas: list[float], cost: float, seed: int) -> dict[str, Any]:
    """A mode's cost against none: pooled and paired, with the noise of the paired figure.

    ``cost_us``: median of all the mode's steps - median of all none steps. ``paired_us``:
    median of the per-round differences (each round's blocks ran back to back, so slow
    drifts of the machine cancel), with a bootstrap 95% interval over rounds; a figure
    whose interval holds 0 cannot be told from no cost at all.
    """
    boot = _bootstrap_median(deltas, seed)
    lo, hi = _quantiles95(boot)
    return {"cost_us": cost, "paired_us": statistics.median(deltas), "ci95_us": [lo, hi],
            "min_us": min(deltas), "max_us": max(deltas), "rounds_us": deltas, "boot": boot}


def measure_config(n_modules: int, target_ms: float, rate: float, rounds: int, budget_ms: float,
                   modes: list[str], recorder: Recorder, evict_mb: float = 0.0) -> dict[str, Any]:
    """All modes on one model size and step time, interleaved round by round.

    Cost of a mode = median of its steps - median of the ``none`` steps (each over all
    rounds), read on both clocks. Noise: the per-round differences (median of the
    mode's block - median of the ``none`` block of the same round), reported as
    min .. max, and the ``none_aa`` control, whose true cost is zero.
    """
    work = Workload(n_modules, evict_mb)
    # Calibrate the pad once, on the uninstrumented step; every mode reuses the same count.
    work.run(5, None)
    body_ns = statistics.median(work.run(15, None)[0])
    work.pad = max(0, int((target_ms * 1e6 - body_ns) * rate))
    steps = max(6, int(budget_ms / max(target_ms, body_ns / 1e6) / rounds))
    clocks = ("cpu", "wall")
    samples: dict[str, dict[str, list[int]]] = {c: {m: [] for m in modes} for c in clocks}
    per_round: dict[str, dict[str, dict[int, float]]] = {c: {m: {} for m in modes} for c in clocks}
    for r in range(rounds):
        # Alternate the order so that no mode always follows the same one.
        for mode in modes if r % 2 == 0 else modes[::-1]:
            n = steps
            if mode == "profiler":
                if r >= PROFILER_ROUNDS:
                    continue
                n = min(steps, PROFILER_MAX_STEPS)
            walls, cpus = run_block(mode, work, n, recorder)
            for clock, times in (("wall", walls), ("cpu", cpus)):
                samples[clock][mode].extend(times)
                per_round[clock][mode][r] = statistics.median(times)
    row: dict[str, Any] = {
        "n_modules": n_modules,
        "target_step_ms": target_ms,
        "unpadded_step_us": body_ns / 1e3,
        "pad_iterations": work.pad,
        "steps_per_mode": steps * rounds,
        "rounds": rounds,
        "evict_mb": evict_mb,
    }
    for clock in clocks:
        base = statistics.median(samples[clock]["none"])
        row[f"none_{clock}_us"] = base / 1e3
        line = [f"modules={n_modules:4d} step~{target_ms:5.1f}ms {clock:4s} none {base / 1e3:9.1f}us"]
        for mode in modes[1:]:
            med = statistics.median(samples[clock][mode])
            rounds_run = per_round[clock][mode]
            deltas = [(v - per_round[clock]["none"][r]) / 1e3 for r, v in rounds_run.items()]
            fig = _summary(deltas, (med - base) / 1e3, seed=zlib.crc32(f"{n_modules}/{target_ms}/{mode}/{clock}".encode()))
            fig["median_us"] = med / 1e3
            fig["pct"] = 100.0 * (med - base) / base
            fig["pct_min"] = 100.0 * min(deltas) * 1e3 / base
            fig["pct_max"] = 100.0 * max(deltas) * 1e3 / base
            row[f"{mode}_{clock}"] = fig
            lo, hi = fig["ci95_us"]
            line.append(f"{mode} {fig['cost_us']:+.2f}us (paired {fig['paired_us']:+.2f} [{lo:+.2f}..{hi:+.2f}])")
        print(" | ".join(line), flush=True)
    return row


# ------------------------------------------------------------------ work count


AGENT_DIR = os.path.join(REPO, "agent") + os.sep


def count_agent_work(n_modules: int, steps: int = 20) -> dict[str, float]:
    """Bytecodes and Python calls the agent executes per traced step, counted exactly.

    The timing figures above are medians of a noisy clock, and at 512 modules the
    step's own variance swamps a few microseconds. This count is deterministic: the
    same Tracer and step as mode ``tracer``, run under ``sys.settrace`` with opcode
    events, counting only frames whose code lies in the agent package. Equal counts
    at every model size show the agent does no per-module work; any growth of the
    timed cost with the module count is then the same code running colder.
    """
    work = Workload(n_modules)
    tracer = Tracer(Recorder(), event_backend=None)
    tracer.install()
    counts = {"bytecodes": 0, "calls": 0}

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            counts["bytecodes"] += 1
        return local

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        if not frame.f_code.co_filename.startswith(AGENT_DIR):
            return None  # torch's and the bench's own frames are not counted
        counts["calls"] += 1
        frame.f_trace_opcodes = True
        return local

    try:
        work.run(5, tracer.trace_step)  # the first step registers the model
        # Python 3.12+ (sys.monitoring underneath settrace) ignores f_trace_opcodes in the
        # first traced session of a code object: 0 opcodes were counted at the first model
        # size on 3.12 and 3.13. One untallied traced pass first makes every size comparable.
        for tally in (False, True):
            if tally:
                counts.update(bytecodes=0, calls=0)
            sys.settrace(on_call)
            try:
                work.run(steps if tally else 2, tracer.trace_step)
            finally:
                sys.settrace(None)
    finally:
        tracer.uninstall()
    return {name: value / steps for name, value in counts.items()}


def measure_work(sizes: list[int]) -> dict[str, dict[str, float]]:
    work = {str(n): count_agent_work(n) for n in sizes}
    per_size = "; ".join(f"{n} modules {w['bytecodes']:.0f} bytecodes in {w['calls']:.0f} calls"
                         for n, w in work.items())
    print(f"(c) agent work per traced step, counted (deterministic, mode tracer): {per_size}", flush=True)
    return work


DEVICE_CALLS = ("mark", "memory", "reset_peak")


def time_device_calls(n_modules: int, target_ms: float, rate: float, seconds: float = 1.0) -> dict[str, float]:
    """The device path's calls on the training thread, timed in place (``--device cuda``).

    The step-difference figures above are medians of whole GPU steps, whose kernel
    launches vary by tens of microseconds on a shared host, so on CUDA their intervals
    are wide. This times only the calls the device path adds to a traced step (event
    records, the allocator statistics read, the peak reset), in a real traced step of the
    same model padded to the same step time: ``perf_counter_ns`` around each call, less
    the timer's own cost (measured around an empty call). Calls per step are exact; the
    sum is what the GPU adds on the training thread to the host-path cost measured with
    the GPU hidden.
    """
    work = Workload(n_modules)
    body_ns = statistics.median(work.run(15, None)[0])
    work.pad = max(0, int((target_ms * 1e6 - body_ns) * rate))
    tracer = Tracer(Recorder())  # its default backend: CUDA events here
    backend = tracer._backend
    if backend is None:
        return {}
    perf = time.perf_counter_ns
    spent = dict.fromkeys(DEVICE_CALLS, 0)
    calls = dict.fromkeys(DEVICE_CALLS, 0)

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            t0 = perf()
            out = fn(*args)
            spent[name] += perf() - t0
            calls[name] += 1
            return out

        return call

    empty = timed("mark", lambda: None)
    for _ in range(20_000):
        empty()
    timer_ns = spent["mark"] / calls["mark"]
    tracer.install()
    try:
        work.run(5, tracer.trace_step)  # the first step registers the model; the pool fills
        tracer.poll()
        for name in DEVICE_CALLS:  # instance attributes: the hooks look them up per call
            spent[name] = calls[name] = 0
            setattr(backend, name, timed(name, getattr(backend, name)))
        # About ``seconds`` of steps (at least 100), whatever the step time.
        steps = max(100, int(seconds * 1e9 / max(target_ms * 1e6, body_ns)))
        done = 0
        while done < steps:
            work.run(20, tracer.trace_step)
            done += 20
            tracer.poll()  # the sender thread's job in real use: returns events to the pool
    finally:
        tracer.uninstall()
        for name in DEVICE_CALLS:
            backend.__dict__.pop(name, None)
    out: dict[str, float] = {"timer_ns": timer_ns}
    for name in DEVICE_CALLS:
        out[f"{name}_calls"] = calls[name] / done
        out[f"{name}_us"] = max(0.0, spent[name] - calls[name] * timer_ns) / done / 1e3
    out["total_us"] = sum(out[f"{name}_us"] for name in DEVICE_CALLS)
    return out


def measure_device_calls(sizes: list[int], targets: list[float], rate: float) -> dict[str, dict[str, float]]:
    """``time_device_calls`` for every model size and step time, keyed "modules@ms"."""
    figures: dict[str, dict[str, float]] = {}
    for target_ms in targets:
        for n in sizes:
            f = figures[f"{n}@{target_ms}"] = time_device_calls(n, target_ms, rate)
            if not f:
                continue
            parts = ", ".join(f"{name} {f[name + '_calls']:.1f} calls {f[name + '_us']:.2f}us" for name in DEVICE_CALLS)
            print(f"(d) device calls per traced ~{target_ms} ms step on the training thread, timed in place, {n:4d} modules: "
                  f"{parts}; total {f['total_us']:.2f}us (timer's own cost {f['timer_ns']:.0f} ns a call, subtracted)",
                  flush=True)
    return figures


# ------------------------------------------------------------------ launch cost


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # No daemon: point the agent and its relay at ports nobody listens on, so the
    # run never touches a daemon (or relay) another job on this machine started.
    env["TRACEML_DAEMON"] = f"127.0.0.1:{_free_port()}"
    env["TRACEML_RELAY_PORT"] = str(_free_port())
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TRACEML_DISABLE"):
        env.pop(var, None)
    return env


INIT_CHILD = (
    "import time, json, torch\n"
    "import agent\n"
    "t0 = time.perf_counter_ns(); agent.init(); t1 = time.perf_counter_ns()\n"
    "agent.shutdown(); t2 = time.perf_counter_ns()\n"
    "print(json.dumps({'init_ns': t1 - t0, 'shutdown_ns': t2 - t1}))\n"
)


def _wall(code: str) -> tuple[float, str]:
    t0 = time.perf_counter_ns()
    out = subprocess.run([sys.executable, "-c", code], env=_child_env(), cwd=REPO, capture_output=True, text=True,
                         check=True, timeout=120)
    return (time.perf_counter_ns() - t0) / 1e6, out.stdout


LAUNCH_CODES = {
    "torch": "import torch",
    # The comparison. agent.init() no longer imports torch (the tracer is built on
    # first use, or on the agent's thread when torch is already there), so on its own it is
    # much cheaper than the baseline, which says little about a training script ...
    "agent": "import agent; agent.init()",
    # ... which imports torch anyway: what the agent adds to that launch, exit included.
    "torch_agent": "import torch; import agent; agent.init()",
}


def measure_launch(runs: int) -> dict[str, Any]:
    walls: dict[str, list[float]] = {name: [] for name in LAUNCH_CODES}
    init_ms: list[float] = []
    shutdown_ms: list[float] = []
    names = list(LAUNCH_CODES)
    for i in range(runs):
        # Rotate the order so a background burst does not always hit the same one.
        for name in names[i % len(names):] + names[:i % len(names)]:
            walls[name].append(_wall(LAUNCH_CODES[name])[0])
        _, out = _wall(INIT_CHILD)
        fig = json.loads(out.strip().splitlines()[-1])
        init_ms.append(fig["init_ns"] / 1e6)
        shutdown_ms.append(fig["shutdown_ns"] / 1e6)
    med = {name: statistics.median(ms) for name, ms in walls.items()}
    res = {
        "launch_torch_ms": med["torch"],
        "launch_agent_init_ms": med["agent"],
        "launch_cost_ms": med["agent"] - med["torch"],
        "launch_torch_agent_init_ms": med["torch_agent"],
        "launch_cost_with_torch_ms": med["torch_agent"] - med["torch"],
        "launch_torch_ms_minmax": [min(walls["torch"]), max(walls["torch"])],
        "launch_agent_init_ms_minmax": [min(walls["agent"]), max(walls["agent"])],
        "launch_torch_agent_init_ms_minmax": [min(walls["torch_agent"]), max(walls["torch_agent"])],
        "init_ms": statistics.median(init_ms),
        "init_ms_minmax": [min(init_ms), max(init_ms)],
        "shutdown_no_daemon_ms": statistics.median(shutdown_ms),
        "launch_runs": runs,
    }

    def span(name: str) -> str:
        return f"{med[name]:.0f}ms [{min(walls[name]):.0f}..{max(walls[name]):.0f}]"

    print(f"launch: python -c 'import agent; agent.init()' {span('agent')} vs baseline python -c 'import torch' "
          f"{span('torch')} -> {res['launch_cost_ms']:+.0f}ms (median of {runs}; init() imports no torch)",
          flush=True)
    print(f"launch: python -c 'import torch; import agent; agent.init()' {span('torch_agent')} vs baseline "
          f"python -c 'import torch' {span('torch')} -> {res['launch_cost_with_torch_ms']:+.0f}ms added",
          flush=True)
    print(f"agent.init() with torch already imported, no daemon: {res['init_ms']:.2f}ms "
          f"[{min(init_ms):.2f}..{max(init_ms):.2f}]; agent.shutdown() then {res['shutdown_no_daemon_ms']:.0f}ms",
          flush=True)
    return res


def _noise(lo: float, hi: float) -> str:
    return " WITHIN NOISE" if lo <= 0.0 <= hi else ""


def report(results: list[dict[str, Any]], modes: list[str], sizes: list[int], targets: list[float],
           clock: str) -> dict[str, Any]:
    """The target figures, each beside its same-run baseline and noise; returns them for the JSON."""
    hot_ms = min(targets)
    hot = {r["n_modules"]: r for r in results if r["target_step_ms"] == hot_ms}
    out: dict[str, Any] = {}
    compared = [m for m in MODES_ALL[1:] if m in modes]
    print(f"(a) cost per step on the training thread ({clock} clock), ~{hot_ms} ms step. median step with the mode - "
          f"median step of none; paired: median of the per-round differences, [bootstrap 95% interval], "
          f"min..max over rounds", flush=True)
    for mode in compared:
        figs: dict[str, Any] = {}
        for n in sizes:
            r = hot[n]
            fig = r[f"{mode}_{clock}"]
            lo, hi = fig["ci95_us"]
            print(f"    {mode:14s} {n:4d} modules: {fig['cost_us']:+7.2f}us  paired {fig['paired_us']:+7.2f}us "
                  f"[{lo:+.2f}..{hi:+.2f}] min..max {fig['min_us']:+.2f}..{fig['max_us']:+.2f}{_noise(lo, hi)}  "
                  f"(none {r[f'none_{clock}_us']:.1f}us, {mode} {fig['median_us']:.1f}us)", flush=True)
            figs[str(n)] = {k: fig[k] for k in ("cost_us", "paired_us", "ci95_us", "min_us", "max_us")}
            figs[str(n)]["none_us"] = r[f"none_{clock}_us"]
        out[f"{mode}_cost_us"] = figs
        lo_n, hi_n = min(sizes), max(sizes)
        if lo_n != hi_n:
            a, b = hot[lo_n][f"{mode}_{clock}"], hot[hi_n][f"{mode}_{clock}"]
            spread = b["paired_us"] - a["paired_us"]
            # Independent resamples of the two configurations' rounds.
            lo, hi = _quantiles95([y - x for x, y in zip(a["boot"], b["boot"], strict=True)])
            out[f"{mode}_spread_us"] = {"paired_us": spread, "ci95_us": [lo, hi],
                                        "pooled_us": b["cost_us"] - a["cost_us"]}
            print(f"    {mode:14s} spread {lo_n} -> {hi_n} modules: paired {spread:+.2f}us [{lo:+.2f}..{hi:+.2f}]"
                  f"{_noise(lo, hi)} (pooled {b['cost_us'] - a['cost_us']:+.2f}us)", flush=True)
    # (b) relative to the ~20 ms step, measured there.
    for r in results:
        if r["target_step_ms"] != 20.0:
            continue
        n = r["n_modules"]
        base = r[f"none_{clock}_us"]
        for mode in [m for m in compared if m != "profiler"]:
            fig = r[f"{mode}_{clock}"]
            lo, hi = fig["ci95_us"]
            rel = {"pct": fig["pct"], "paired_pct": 100.0 * fig["paired_us"] / base,
                   "ci95_pct": [100.0 * lo / base, 100.0 * hi / base],
                   "pct_min": fig["pct_min"], "pct_max": fig["pct_max"], "none_us": base}
            derived = ""
            if str(n) in out.get(f"{mode}_cost_us", {}) and hot_ms != 20.0:
                rel["from_hot_pct"] = 100.0 * out[f"{mode}_cost_us"][str(n)]["paired_us"] / base
                derived = f"; {hot_ms} ms-step paired cost / this step {rel['from_hot_pct']:+.4f}%"
            out.setdefault(f"{mode}_relative_20ms", {})[str(n)] = rel
            print(f"(b) {mode:14s} relative to the 20 ms step, {n:4d} modules ({clock}): {fig['pct']:+.4f}% "
                  f"paired {rel['paired_pct']:+.4f}% [{rel['ci95_pct'][0]:+.4f}..{rel['ci95_pct'][1]:+.4f}]"
                  f"{_noise(lo, hi)} min..max {fig['pct_min']:+.4f}..{fig['pct_max']:+.4f} "
                  f"(none {base / 1e3:.3f}ms){derived}", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long", action="store_true", help="more rounds and steps (several minutes)")
    ap.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    ap.add_argument("--no-profiler", action="store_true")
    ap.add_argument("--no-public", action="store_true", help="skip the agent.init()/agent.trace_step mode")
    ap.add_argument("--no-launch", action="store_true")
    ap.add_argument("--modes", default="",
                    help="modes to compare with none, comma-separated, from "
                         f"{', '.join(MODES_ALL[1:])} (default: none_aa, null, tracer, public, profiler)")
    ap.add_argument("--modules", default="4,64,512", help="model sizes (comma-separated module counts)")
    ap.add_argument("--targets", default="0.3,2,20", help="padded step times in ms (0.3 gives the (a) figures)")
    ap.add_argument("--reference", default="",
                    help="a module path holding another build's Tracer (e.g. a copy of the agent package "
                         "from an older commit, renamed): adds mode tracer_ref")
    ap.add_argument("--evict-mb", type=float, default=0.0,
                    help="cold-cache control: the model's first module walks this many MiB in forward and "
                         "backward, and so does the padding (see Evict)")
    ap.add_argument("--rounds", type=int, default=0, help="interleaved rounds (default 12; --quick 4, --long 24)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: model on the GPU, batch copied in the step, phases timed with CUDA events "
                         "(the training thread's cost then includes recording them)")
    ap.add_argument("--budget-ms", type=float, default=0.0,
                    help="timed ms per mode per configuration (default 2500; --quick 800, --long 6000)")
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    torch.set_num_threads(1)
    rounds = args.rounds or (24 if args.long else (4 if args.quick else 12))
    budget_ms = args.budget_ms or (6000.0 if args.long else (800.0 if args.quick else 2500.0))
    if args.modes:
        modes = ["none"] + [m for m in args.modes.split(",") if m and m != "none"]
    else:
        modes = ["none", "none_aa", "null", "tracer"] + ([] if args.no_public else ["public"])
        modes += [] if args.no_profiler else ["profiler"]
    if args.reference:
        import importlib

        REFERENCE_TRACER.append(importlib.import_module(args.reference).Tracer)
        if "tracer_ref" not in modes:
            modes.insert(modes.index("tracer") if "tracer" in modes else len(modes), "tracer_ref")
    unknown = sorted(set(modes) - set(MODES_ALL))
    if unknown:
        ap.error(f"unknown modes: {', '.join(unknown)}")
    if "public" in modes:
        start_public()
    recorder = Recorder()
    rate = calibrate_spin()
    print(f"device {DEVICE}; spin calibration: {rate * 1e3:.1f} iterations/us; modes {', '.join(modes)} run interleaved, "
          f"{rounds} rounds, {budget_ms:.0f} timed ms per mode per configuration", flush=True)
    sizes = [int(n) for n in args.modules.split(",")]
    targets = [float(ms) for ms in args.targets.split(",")]
    results = [measure_config(n, ms, rate, rounds, budget_ms, modes, recorder, args.evict_mb)
               for n in sizes for ms in targets]
    figures = report(results, modes, sizes, targets, "cpu")
    figures_wall = report(results, modes, sizes, targets, "wall")
    work = measure_work(sizes)
    device_calls = measure_device_calls(sizes, targets, rate) if DEVICE.type == "cuda" else {}
    launch = {} if args.no_launch else measure_launch(3 if not args.long else 7)
    if "public" in modes:
        agent.shutdown()
    for r in results:  # the resamples were for the intervals above; too long for the JSON line
        for value in r.values():
            if isinstance(value, dict):
                value.pop("boot", None)
    print(json.dumps({"device": args.device, "configs": results, "cpu": figures, "wall": figures_wall, "agent_work_per_step": work,
                      "device_calls_per_step": device_calls, **launch}))


if __name__ == "__main__":
    main()
