"""Step times outside a profile asked on demand, against a run with no profile.

Two runs of the same invocation: ``torchrun`` (gloo, CPU, ``--ranks`` ranks) of
tests/support/profile_job.py (one DDP ``nn.Linear``, a ``--step-s`` sleep inside
each traced step), ``--steps`` steps, through a real ``traceml-daemon serve``
and the node relay each run starts. In run B, once every rank has stored a few
steps, ``traceml-daemon profile --rank R --steps K`` asks rank R for a
torch.profiler trace of its next K steps; run A asks nothing (both poll the
database alike until the first steps are stored). Each rank writes
its own wall time of every traced step (measured around ``trace_step``).

Printed per rank: the median step time of run A, and of run B's steps outside
the profile. The profile covers steps first..first+K-1; the trace is written at
the enter of step first+K (torch.profiler stops at a step boundary), so that
step is left out too and its time is printed apart, with the median of the
profiled steps. Runs alternate (A, B, A, B ...) for ``--rounds`` rounds; the
medians pooled over rounds are printed with each round's. Ends with one JSON line.

    .venv/bin/python bench/profile_on_demand.py [--ranks 2] [--steps 300] [--step-s 0.01] [--profile-steps 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.procs import REPO, DaemonProcess, base_env, cli, free_port, torchrun, wait_for_steps  # noqa: E402

JOB = REPO / "tests" / "support" / "profile_job.py"


def one_run(tmp: Path, name: str, args: argparse.Namespace, ask: bool) -> dict[str, Any]:
    db = tmp / f"{name}.db"
    times = tmp / f"{name}.times"
    daemon = DaemonProcess(db).start()
    asked: dict[str, Any] = {}
    try:
        env = base_env(TRACEML_DAEMON=daemon.address, TRACEML_RELAY_PORT=str(free_port()),
                       TRACEML_PROFILE_DIR=str(tmp / f"{name}-profiles"))
        job = torchrun(JOB, ["--steps", str(args.steps), "--step-s", str(args.step_s), "--times", str(times)],
                       nproc=args.ranks, env=env, background=True)

        def request() -> None:
            # Both runs poll for the first steps alike (summary subprocesses load this machine's CPUs).
            wait_for_steps(db, ranks=args.ranks, steps=20, timeout=120)
            if not ask:
                return
            done = cli("profile", "--db", str(db), "--rank", str(args.rank), "--steps", str(args.profile_steps),
                       "--wait", "120", "--json")
            asked.update(json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr.strip()})

        asker = threading.Thread(target=request)
        asker.start()
        out, _ = job.communicate(timeout=600)
        asker.join()
        if job.returncode != 0:
            raise SystemExit(f"job failed:\n{out[-4000:]}")
    finally:
        daemon.stop()
    if ask and "error" in asked:
        raise SystemExit(f"profile request failed: {asked['error']}")
    per_rank = {r: json.loads(Path(f"{times}.{r}").read_text()) for r in range(args.ranks)}
    return {"times": per_rank, "trace": asked or None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--step-s", type=float, default=0.01, help="sleep inside each step")
    p.add_argument("--rank", type=int, default=1, help="the rank profiled in run B")
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    skip = 10  # the first steps (warm-up, connection set-up) are left out of both runs
    pooled_a: dict[int, list[float]] = {r: [] for r in range(args.ranks)}
    pooled_b: dict[int, list[float]] = {r: [] for r in range(args.ranks)}
    profiled: list[float] = []
    boundary: list[float] = []
    rounds = []
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        for i in range(args.rounds):
            a = one_run(tmp, f"a{i}", args, ask=False)
            b = one_run(tmp, f"b{i}", args, ask=True)
            trace = b["trace"]
            first, k = trace["step"], trace["steps"]
            out = set(range(first, first + k + 1))
            row = {"round": i, "profiled_steps": [first, first + k - 1]}
            for r in range(args.ranks):
                ta = a["times"][r][skip:]
                tb = [t for s, t in enumerate(b["times"][r]) if s >= skip and s not in out]
                pooled_a[r] += ta
                pooled_b[r] += tb
                row[f"rank{r}_ms"] = [round(statistics.median(ta) * 1e3, 3), round(statistics.median(tb) * 1e3, 3)]
            mine = b["times"][args.rank]
            profiled += mine[first:first + k]
            boundary.append(mine[first + k])
            rounds.append(row)
            print(f"round {i}: profiled steps {first}-{first + k - 1} of rank {args.rank}; median step ms "
                  + ", ".join(f"rank {r}: no profile {row[f'rank{r}_ms'][0]:.3f} / outside the profile "
                              f"{row[f'rank{r}_ms'][1]:.3f}" for r in range(args.ranks)), flush=True)
    result: dict[str, Any] = {"ranks": args.ranks, "steps": args.steps, "step_s": args.step_s,
                              "profile_steps": args.profile_steps, "rounds": rounds}
    print("pooled median step time (ms), run without a profile vs the same steps' run with one, outside it:")
    for r in range(args.ranks):
        ma, mb = statistics.median(pooled_a[r]) * 1e3, statistics.median(pooled_b[r]) * 1e3
        result[f"rank{r}_ms"] = [round(ma, 3), round(mb, 3)]
        print(f"  rank {r}: {ma:.3f} vs {mb:.3f} ({mb - ma:+.3f} ms)")
    print(f"  rank {args.rank}, profiled steps: median {statistics.median(profiled) * 1e3:.3f} ms; the step that "
          f"writes the trace: median {statistics.median(boundary) * 1e3:.1f} ms")
    result["profiled_ms"] = round(statistics.median(profiled) * 1e3, 3)
    result["trace_write_step_ms"] = round(statistics.median(boundary) * 1e3, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
