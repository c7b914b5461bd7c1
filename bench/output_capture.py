"""Output capture's cost: a step that prints nothing, a printed line, and 10,000 lines/s.

Each part runs in a child process whose stdout and stderr go to a file (the
console), with capture on (``agent.output_capture.OutputCapture`` on fds 1 and 2,
as the agent installs it) and off, block by block in the same run:

(a) quiet steps: a fixed amount of CPU work (about ``--step-us``) that prints nothing,
    in blocks with capture on and off alternating in one process; the median step
    of each block, on against off paired by round (4 x ``--rounds`` rounds);
(b) per line: ``--lines`` lines printed with ``print(..., flush=True)`` (one
    write per line, the dearest case: what PYTHONUNBUFFERED or a log handler
    does), then the capture drained and stopped; the extra wall time and the
    extra process CPU time per line, on against off;
(c) a paced rate: ``--rate`` lines/s for ``--seconds`` with capture on; the
    console file must hold every line in order, and the capture every line below
    its rate limit (lines_seen, kept, dropped, reordered counted).

    .venv/bin/python bench/output_capture.py [--rounds 7] [--lines 50000] [--rate 10000] [--seconds 3]

Targets (docs/performance.md): (a) not measurable, (b) <= 5 us per line. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- child side


def _work(iters: int) -> int:
    """A fixed amount of work (not a fixed time, which would absorb any overhead)."""
    x = 0
    for i in range(iters):
        x += i
    return x


def _timed(iters: int) -> int:
    t0 = time.perf_counter_ns()
    _work(iters)
    return time.perf_counter_ns() - t0


def _iters_for(step_us: float) -> int:
    """Iterations of ``_work`` that take about ``step_us`` here (calibrated once, in the parent)."""
    iters = 1000
    while True:
        took = min(_timed(iters) for _ in range(5))  # the least of five: a preemption only adds
        if took > 2_000_000:
            return max(1, int(iters * step_us * 1000 / took))
        iters *= 2


def _child_quiet(rounds: int, steps: int, iters: int) -> dict[str, Any]:
    """Blocks of steps with capture off and on alternating in this one process (a fresh
    capture per on-block): per round, the median step of each."""
    from agent.output_capture import OutputCapture

    out: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(rounds):
        for mode in (("on", "off") if r % 2 else ("off", "on")):
            cap = OutputCapture() if mode == "on" else None
            if cap is not None:
                cap.start()
            times = []
            for _ in range(steps):
                t0 = time.perf_counter_ns()
                _work(iters)
                times.append(time.perf_counter_ns() - t0)
            if cap is not None:
                cap.stop()
            out[mode].append(statistics.median(times))
    return out


def _child_lines(capture_on: bool, lines: int) -> dict[str, Any]:
    from agent.output_capture import OutputCapture

    # Above the bench's line count: (b) measures the cost per line, not the rate limit.
    cap = OutputCapture(lines_per_s=1e9, burst_lines=10**9, pending_bytes=1 << 30) if capture_on else None
    if cap is not None:
        cap.start()
    text = "step 123 loss 0.4567 lr 0.0001 throughput 1234.5 samples/s"
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(lines):
        print(text, flush=True)
    if cap is not None:
        cap.stop(5.0)  # reads the pipes out: what the reader has left is part of the cost
        kept = len((cap.drain() or {"line": []})["line"])
    else:
        kept = 0
    return {"wall_s": time.perf_counter() - w0, "cpu_s": time.process_time() - c0, "kept": kept}


def _child_rate(rate: float, seconds: float) -> dict[str, Any]:
    from agent.output_capture import OutputCapture

    cap = OutputCapture()
    cap.start()
    total = int(rate * seconds)
    t0 = time.perf_counter()
    kept: list[str] = []
    for i in range(total):
        due = t0 + i / rate
        while time.perf_counter() < due:
            pass
        print(f"line {i:08d}", flush=True)
        if i % 2000 == 1999:  # the sender thread drains about once a second
            cols = cap.drain()
            kept += cols["line"] if cols else []
    cap.stop(5.0)
    cols = cap.drain()
    kept += cols["line"] if cols else []
    return {"sent": total, "kept": kept, "seen": cap.lines_seen, "counters": cap.counters(),
            "elapsed_s": time.perf_counter() - t0}


def child(args: argparse.Namespace) -> None:
    if args.part == "quiet":
        out = _child_quiet(args.rounds, args.steps, args.iters)
    elif args.part == "lines":
        out = _child_lines(args.capture == "on", args.lines)
    else:
        out = _child_rate(args.rate, args.seconds)
    with open(args.result, "w") as fh:
        json.dump(out, fh)


# ---------------------------------------------------------------- parent side


def _run(part: str, capture: str, extra: list[str], console: Path) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        result = Path(fh.name)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(console, "wb") as out:
        subprocess.run([sys.executable, __file__, "--child", "--part", part, "--capture", capture,
                        "--result", str(result), *extra], stdout=out, stderr=out, env=env, check=True)
    data = json.loads(result.read_text())
    result.unlink()
    return dict(data)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=1000, help="(a) steps per block")
    p.add_argument("--step-us", type=float, default=200.0, help="(a) the step's spin, microseconds")
    p.add_argument("--lines", type=int, default=50_000, help="(b) lines per block")
    p.add_argument("--rate", type=float, default=10_000.0, help="(c) lines per second")
    p.add_argument("--seconds", type=float, default=3.0, help="(c) how long")
    p.add_argument("--iters", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--part", default="quiet", help=argparse.SUPPRESS)
    p.add_argument("--capture", default="off", help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    tmp = Path(tempfile.mkdtemp(prefix="bench-capture-"))
    console = tmp / "console.txt"

    # (a) quiet steps, on and off alternating, paired by round
    iters = _iters_for(args.step_us)
    quiet = _run("quiet", "both", ["--rounds", str(4 * args.rounds), "--steps", str(args.steps), "--iters",
                                   str(iters)], console)
    diffs = [(a - b) / 1000 for a, b in zip(quiet["on"], quiet["off"], strict=True)]
    quiet_off_us = statistics.median(quiet["off"]) / 1000
    quiet_diff_us = statistics.median(diffs)
    q1, _, q3 = statistics.quantiles(diffs, n=4)
    spread_us = (q3 - q1) / 2  # half the interquartile range of the paired differences: the noise
    print(f"(a) quiet step (~{args.step_us:g} us of fixed work): capture off {quiet_off_us:.2f} us, on - off "
          f"{quiet_diff_us:+.3f} us median of {len(diffs)} paired rounds (interquartile {q1:+.3f} .. {q3:+.3f} us)"
          + ("  WITHIN NOISE" if q1 <= 0 <= q3 else ""))

    # (b) per printed line, flush=True
    per: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    for r in range(args.rounds):
        for mode in (("on", "off") if r % 2 else ("off", "on")):
            per[mode].append(_run("lines", mode, ["--lines", str(args.lines)], console))
    wall = [(a["wall_s"] - b["wall_s"]) / args.lines * 1e6 for a, b in zip(per["on"], per["off"], strict=True)]
    cpu = [(a["cpu_s"] - b["cpu_s"]) / args.lines * 1e6 for a, b in zip(per["on"], per["off"], strict=True)]
    base_wall = statistics.median(x["wall_s"] for x in per["off"]) / args.lines * 1e6
    base_cpu = statistics.median(x["cpu_s"] for x in per["off"]) / args.lines * 1e6
    lost = sum(args.lines - x["kept"] for x in per["on"])
    print(f"(b) per line printed (print flush=True, {args.lines:,} lines): capture off {base_wall:.2f} us wall, "
          f"{base_cpu:.2f} us CPU; on - off {statistics.median(wall):+.2f} us wall, {statistics.median(cpu):+.2f} us "
          f"CPU (both threads) per line; lines lost to capture {lost}")

    # (c) a paced 10,000 lines/s
    rate = _run("rate", "on", ["--rate", str(args.rate), "--seconds", str(args.seconds)], console)
    expected = [f"line {i:08d}" for i in range(rate["sent"])]
    on_console = console.read_text().splitlines()
    console_in_order = on_console == expected
    kept = rate["kept"]
    in_order = kept == sorted(kept)
    dropped = sum(rate["counters"].values())
    print(f"(c) {args.rate:,.0f} lines/s for {args.seconds:g} s ({rate['sent']:,} lines, took {rate['elapsed_s']:.2f} s): "
          f"console has all in order: {console_in_order}; captured {len(kept):,} of {rate['seen']:,} seen, "
          f"in order: {in_order}, lost {rate['sent'] - len(kept)}, drop counters {rate['counters']}")
    print(json.dumps({
        "quiet_step_off_us": round(quiet_off_us, 3),
        "quiet_step_on_minus_off_us": round(quiet_diff_us, 3),
        "quiet_step_iqr_half_us": round(spread_us, 3),
        "quiet_step_within_noise": q1 <= 0 <= q3,
        "line_off_wall_us": round(base_wall, 3),
        "line_off_cpu_us": round(base_cpu, 3),
        "line_on_minus_off_wall_us": round(statistics.median(wall), 3),
        "line_on_minus_off_cpu_us": round(statistics.median(cpu), 3),
        "lines_lost_b": lost,
        "rate_lines_per_s": args.rate,
        "rate_sent": rate["sent"],
        "rate_captured": len(kept),
        "rate_console_in_order": console_in_order,
        "rate_captured_in_order": in_order,
        "rate_dropped_counted": dropped,
    }))


if __name__ == "__main__":
    main()
