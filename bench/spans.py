"""Calling-thread cost of spans and session phases, and sessions delivered at 10,000/s.

Part 1 (in process, the agent active, no relay listening: a job whose daemon is
down, so every row stays in the agent's bounded buffers until a flush drains it):
each variant runs a block of N iterations, variants interleaved block by block
for R rounds so a noisy machine hits them alike; the figure of a variant is the
median over rounds of (its block - the same-round ``none`` block) / N, with the
min..max over rounds. Variants:

* ``none``: the bare loop body (``with NULL:`` on a no-op context manager),
  the baseline every cost is taken against;
* ``span``: ``with agent.span("x")``; ``span_args``: with a category and two args;
* ``async_span``: ``async with agent.span("x")`` inside an asyncio task
  (baseline: ``async with`` a no-op async context manager);
* ``trace_perf``: a call of a ``@agent.trace_perf`` function (baseline: the plain function);
* ``instant``: ``agent.instant("x")`` (baseline: an empty call);
* ``phase``: ``with agent.trace_session_phase("generate")`` inside a session
  (baseline: ``none``); ``async_phase``: the same with ``async with``;
* ``session``: a whole session: a ``@agent.session_context()`` call holding two
  phases and its ``mark_finalized`` (baseline: the undecorated coroutine's call).

Part 2 (``--rate``, default 10,000 sessions/s, ``--seconds``): a real
``traceml-daemon serve`` and a child process whose event loop opens sessions at
that pace (each: generate and reward phases, then mark_finalized), then shuts
the agent down; the daemon is stopped and the stored final rows are counted
against the sessions made (``lost`` must be 0), beside the agent's own drop
counters. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import agent  # noqa: E402

NULL = contextlib.nullcontext()


class _ANull:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> bool:
        return False


ANULL = _ANull()

# The figure is the calling thread's CPU time: what a span costs that thread, without the
# time it sat descheduled on a shared machine (--wall: wall time instead).
_clock = time.thread_time_ns


def _sync_block(body: Callable[[], None], n: int) -> float:
    t0 = _clock()
    for _ in range(n):
        body()
    return (_clock() - t0) / n


def variants() -> dict[str, Callable[[int], float]]:
    def none(n: int) -> float:
        t0 = _clock()
        for _ in range(n):
            with NULL:
                pass
        return (_clock() - t0) / n

    def span(n: int) -> float:
        t0 = _clock()
        for _ in range(n):
            with agent.span("x"):
                pass
        return (_clock() - t0) / n

    def span_args(n: int) -> float:
        t0 = _clock()
        for i in range(n):
            with agent.span("x", category="compute", global_step=i, batch=32):
                pass
        return (_clock() - t0) / n

    def plain() -> int:
        return 1

    @agent.trace_perf("f", category="compute")
    def traced() -> int:
        return 1

    def call_plain(n: int) -> float:
        return _sync_block(plain, n)

    def call_traced(n: int) -> float:
        return _sync_block(traced, n)

    def empty(name: str) -> None:
        return None

    def call_empty(n: int) -> float:
        t0 = _clock()
        for _ in range(n):
            empty("x")
        return (_clock() - t0) / n

    def instant(n: int) -> float:
        t0 = _clock()
        for _ in range(n):
            agent.instant("x")
        return (_clock() - t0) / n

    @agent.session_context()
    def in_session(n: int) -> float:
        t0 = _clock()
        for _ in range(n):
            with agent.trace_session_phase("generate"):
                pass
        elapsed = (_clock() - t0) / n
        agent.trace_session_event("mark_finalized", status="accepted")
        return elapsed

    async def a_none(n: int) -> float:
        t0 = _clock()
        for _ in range(n):
            async with ANULL:
                pass
        return (_clock() - t0) / n

    async def a_span(n: int) -> float:
        t0 = _clock()
        for _ in range(n):
            async with agent.span("x"):
                pass
        return (_clock() - t0) / n

    @agent.session_context()
    async def a_phase_in_session(n: int) -> float:
        t0 = _clock()
        for _ in range(n):
            async with agent.trace_session_phase("generate"):
                pass
        elapsed = (_clock() - t0) / n
        agent.trace_session_event("mark_finalized", status="accepted")
        return elapsed

    async def bare_session() -> None:
        async with ANULL:
            pass
        async with ANULL:
            pass

    @agent.session_context()
    async def traced_session() -> None:
        async with agent.trace_session_phase("generate"):
            pass
        async with agent.trace_session_phase("reward"):
            pass
        agent.trace_session_event("mark_finalized", status="accepted")

    async def sessions_of(fn: Callable[[], Any], n: int) -> float:
        t0 = _clock()
        for _ in range(n):
            await fn()
        return (_clock() - t0) / n

    def in_task(coro_fn: Callable[[int], Any]) -> Callable[[int], float]:
        def run(n: int) -> float:
            async def main() -> float:
                return await asyncio.create_task(coro_fn(n))

            return asyncio.run(main())

        return run

    return {
        "none": none,
        "span": span,
        "span_args": span_args,
        "call_plain": call_plain,
        "trace_perf": call_traced,
        "call_empty": call_empty,
        "instant": instant,
        "phase": in_session,
        "async_none": in_task(a_none),
        "async_span": in_task(a_span),
        "async_phase": in_task(a_phase_in_session),
        "session_bare": in_task(lambda n: sessions_of(bare_session, n)),
        "session": in_task(lambda n: sessions_of(traced_session, n)),
    }


# variant -> the baseline it is taken against
PAIRS = {
    "span": "none", "span_args": "none", "trace_perf": "call_plain", "instant": "call_empty", "phase": "none",
    "async_span": "async_none", "async_phase": "async_none", "session": "session_bare",
}


def part1(rounds: int, n: int) -> dict[str, Any]:
    agent.init(start_relay=False, relay_port=_closed_port(), flush_s=0.2)
    runs = variants()
    per: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            per[name].append(fn(n))
    out: dict[str, Any] = {}
    for name, base in PAIRS.items():
        diffs = [a - b for a, b in zip(per[name], per[base], strict=True)]
        out[name] = {"cost_ns": statistics.median(diffs), "min_ns": min(diffs), "max_ns": max(diffs),
                     "with_ns": statistics.median(per[name]), "baseline": base,
                     "baseline_ns": statistics.median(per[base])}
    from agent import runtime

    rt = runtime.current
    out["agent_counters"] = rt._counters() if rt is not None else {}
    agent.shutdown()
    return out


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CHILD = r"""
import asyncio, sys, time, json
import agent
rate, seconds = float(sys.argv[1]), float(sys.argv[2])
agent.init()

@agent.trace_session("reward")
def reward():
    return 1.0

@agent.session_context()
async def one():
    async with agent.trace_session_phase("generate"):
        pass
    reward()
    agent.trace_session_event("mark_finalized", status="accepted")

async def main():
    made = 0
    t0 = time.perf_counter()
    total = int(rate * seconds)
    agent.set_task_id()
    while made < total:
        due = int((time.perf_counter() - t0) * rate) + 1
        while made < min(due, total):
            await one()
            made += 1
        await asyncio.sleep(0.001)
    return made, time.perf_counter() - t0

made, took = asyncio.run(main())
from agent import runtime
counters = runtime.current._counters()
agent.shutdown()
print(json.dumps({"made": made, "seconds": took, "counters": counters}))
"""


def part2(rate: float, seconds: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "bench.db"
        port, relay = _closed_port(), _closed_port()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TRACEML_DAEMON": f"127.0.0.1:{port}",
               "TRACEML_RELAY_PORT": str(relay), "TRACEML_SHUTDOWN_S": "20"}
        daemon = subprocess.Popen([sys.executable, "-m", "traceml_daemon", "serve", "--port", str(port), "--db",
                                   str(db)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
                time.sleep(0.1)
            child = subprocess.run([sys.executable, "-c", CHILD, str(rate), str(seconds)], env=env,
                                   capture_output=True, text=True, timeout=seconds + 120)
            if child.returncode != 0:
                raise SystemExit(f"child failed: {child.stderr}")
            made = json.loads(child.stdout.strip().splitlines()[-1])
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(timeout=60)
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        stored = con.execute("SELECT count(DISTINCT session_id) FROM rollout_sessions WHERE status='accepted'").fetchone()[0]
        phases = con.execute("SELECT count(*) FROM session_phases").fetchone()[0]
        con.close()
    return {"rate_per_s": rate, "made": made["made"], "achieved_per_s": made["made"] / made["seconds"],
            "stored": stored, "phases_stored": phases, "lost": made["made"] - stored,
            "agent_counters": made["counters"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("-n", type=int, default=20_000, help="iterations per block")
    p.add_argument("--rate", type=float, default=10_000.0, help="sessions per second in part 2")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--skip-delivery", action="store_true", help="part 1 only")
    p.add_argument("--wall", action="store_true", help="time part 1 on the wall clock, not the thread's CPU time")
    args = p.parse_args()
    if args.wall:
        global _clock
        _clock = time.perf_counter_ns
    figures: dict[str, Any] = {"part1": part1(args.rounds, args.n), "clock": "wall" if args.wall else "thread_cpu"}
    clock = "wall" if args.wall else "thread CPU"
    print(f"calling-thread cost ({clock} time), median of {args.rounds} rounds x {args.n} (min..max), "
          "against the same-run baseline:")
    for name, f in figures["part1"].items():
        if name == "agent_counters":
            continue
        print(f"  {name:<12} {f['cost_ns'] / 1e3:6.2f} us  ({f['min_ns'] / 1e3:.2f}..{f['max_ns'] / 1e3:.2f})"
              f"   with {f['with_ns'] / 1e3:6.2f} us, {f['baseline']} {f['baseline_ns'] / 1e3:6.2f} us")
    if not args.skip_delivery:
        d = figures["part2"] = part2(args.rate, args.seconds)
        print(f"delivery: {d['made']} sessions made at {d['achieved_per_s']:.0f}/s (asked {d['rate_per_s']:.0f}/s), "
              f"{d['stored']} stored finalized, lost {d['lost']}; {d['phases_stored']} phase rows; "
              f"agent drops: {json.dumps({k: v for k, v in d['agent_counters'].items() if v})}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
