"""Step end to visible in the TUI, through every real hop.

A real run: ``torchrun`` (gloo, CPU, ``--ranks`` ranks) of a small DDP model
traced by the agent; local rank 0 hosts the node relay; the relay forwards to
a real ``traceml-daemon serve`` writing SQLite; the real ``TraceApp`` runs
headless in this process (Textual's ``run_test``) at its own refresh settings
and reads the database the way ``traceml-daemon tui`` does.

Per step and rank, wall-clock times (one host, one clock):

* ``end``: the training script's ``time.time()`` right after ``trace_step`` exits
  (the agent's own ``steps.ts`` is reported beside it as a sanity check);
* ``sent``: the agent's flush that carried the step (the batch's ``sent_ts``);
* ``arrived``: the relay's ``rbatch`` holding it reached the daemon's socket, seen
  by a pass-through TCP proxy between relay and daemon that parses frames;
* ``committed``: first seen in the database by a 10 ms read-only poller;
* ``visible``: the first TUI paint (``call_after_refresh`` after the screen got the
  snapshot) whose rank table shows the step.

latency = visible - end; its parts: agent flush wait (sent - end), relay
(arrived - sent: loopback hop plus the relay's packing interval), daemon commit
(committed - arrived), TUI wait (start of the read that saw it - committed) and
TUI read+paint (visible - read start). Same-run baseline: the polling ceiling,
the sum of the configured intervals (agent flush + relay packing + TUI poll),
which bounds the waiting part of any step's latency. Steps of the first and
last second of each run (connection set-up, the final flush at shutdown) are
left out.

The hops' timers run at fixed phases, so one run's p99 depends on where its
phases fell: runs are repeated (``--runs``) and reported each and pooled.
``--flush-s default,0.5`` runs with TRACEML_FLUSH_S unset and set to 0.5.

    .venv/bin/python bench/latency.py [--ranks 2] [--seconds 20] [--runs 3] [--flush-s default]

Target (docs/performance.md): p99 <= 1.5 s. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SETTLE_S = 1.0  # steps this close to a run's start or end are left out
_RANK_IN_SENDER = re.compile(r"/r(\d+)/")


# ------------------------------------------------------------ the training job


def train(out_dir: str, steps: int, step_ms: float) -> None:
    """Run under torchrun: a small DDP model, one wall-clock time per finished step."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import agent

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    agent.init()
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1))
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 64), torch.randn(32, 1)
    ends: list[float] = []
    for _ in range(steps):
        with agent.trace_step(model):
            time.sleep(step_ms / 1e3)  # stands in for compute: keeps the 2-core machine free for the hops
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        ends.append(time.time())
    agent.shutdown()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(ends))
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------ observers


class FrameProxy:
    """relay -> proxy -> daemon on loopback; records when each rank's steps arrive.

    Bytes are forwarded as they come (the handshake's MAC binds no address); a
    copy of the relay's stream is decoded to read each ``rbatch``'s items.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self.arrived: dict[tuple[int, int], tuple[float, float]] = {}  # (rank, step) -> (sent_ts, arrival)
        self.agent_batches = 0
        self.span = (0.0, 0.0)  # first and last rbatch arrival
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()

    def start(self) -> FrameProxy:
        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop)
        self._ready.wait(10)
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)

    async def _serve(self) -> None:
        server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, inspect: bool) -> None:
            from traceml_wire.framing import FrameDecoder

            decoder = FrameDecoder()
            try:
                while data := await src.read(1 << 16):
                    dst.write(data)
                    now = time.time()
                    if inspect:
                        for frame in decoder.feed(data):
                            self._record(frame, now)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pump(reader, up_writer, True), pump(up_reader, writer, False))

    def _record(self, frame: bytes, now: float) -> None:
        import msgpack

        msg = msgpack.unpackb(frame, raw=False, strict_map_key=False)
        if not isinstance(msg, dict) or msg.get("t") != "rbatch":
            return
        self.span = (self.span[0] or now, now)
        for sender, _seq, body in msg.get("items", []):
            self.agent_batches += 1
            m = _RANK_IN_SENDER.search(str(sender))
            payload = msgpack.unpackb(body, raw=False, strict_map_key=False)
            steps = payload.get("tables", {}).get("steps", {}).get("step", [])
            if m is None:
                continue
            for step in steps:
                self.arrived.setdefault((int(m.group(1)), int(step)), (float(payload.get("sent_ts", 0.0)), now))


class CommitPoller:
    """When each (rank, step) first became readable in the database (10 ms resolution)."""

    def __init__(self, db: str, interval: float = 0.01) -> None:
        self.db = db
        self.interval = interval
        self.committed: dict[tuple[int, int], tuple[float, float]] = {}  # (rank, step) -> (agent ts, seen)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> CommitPoller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        con = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True)
        last, ranks = 0, {}
        while not self._stop.wait(self.interval):
            try:
                rows = con.execute("SELECT rowid, rank_id, step, ts FROM steps WHERE rowid>?", (last,)).fetchall()
                if rows and any(r[1] not in ranks for r in rows):
                    ranks = dict(con.execute("SELECT rank_id, global_rank FROM ranks"))
            except sqlite3.OperationalError:  # schema not created yet
                continue
            now = time.time()
            for rowid, rank_id, step, ts in rows:
                last = max(last, rowid)
                self.committed.setdefault((int(ranks.get(rank_id, rank_id)), int(step)), (float(ts), now))
        con.close()


def make_app(db: str) -> Any:
    """The real TraceApp, noting when each paint that shows a new snapshot lands."""
    from traceml_daemon.tui.app import TraceApp

    class TimedApp(TraceApp):
        def __init__(self, path: str) -> None:
            super().__init__(path)
            self.paints: list[tuple[float, float, dict[int, int]]] = []  # (read start, painted, rank -> last step)

        def _apply(self, snap: Any, target: Any, error: Any) -> None:
            read_start = time.time() - self.last_read_s
            super()._apply(snap, target, error)
            if snap is not None:
                shown = {r.global_rank: r.last_step for r in snap.overview.ranks if r.last_step is not None}
                self.call_after_refresh(lambda: self.paints.append((read_start, time.time(), shown)))

    return TimedApp(db)


# ------------------------------------------------------------ one run


@dataclass
class Run:
    latency: list[float] = field(default_factory=list)
    parts: dict[str, list[float]] = field(default_factory=dict)
    ts_vs_end: list[float] = field(default_factory=list)  # agent steps.ts - script end (sanity)
    steps: int = 0
    seconds: float = 0.0
    agent_batches: int = 0
    forwarding_s: float = 0.0  # first to last rbatch at the daemon
    ranks: int = 0
    daemon_cpu_pct: float = 0.0
    ranks_cpu_pct: float = 0.0
    tui: dict[str, float] = field(default_factory=dict)


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_run(tmp: str, ranks: int, steps: int, step_ms: float, flush_s: str) -> Run:
    import psutil

    from tests.support.procs import DaemonProcess, base_env, free_port, torchrun

    db = os.path.join(tmp, "run.db")
    out = os.path.join(tmp, "ends")
    os.makedirs(out, exist_ok=True)
    with DaemonProcess(Path(db)).start() as daemon:
        assert daemon.proc is not None
        while not os.path.exists(db):
            time.sleep(0.05)
        proxy = FrameProxy(daemon.port).start()
        poller = CommitPoller(db).start()
        env = base_env(TRACEML_DAEMON=f"127.0.0.1:{proxy.port}", TRACEML_RELAY_PORT=str(free_port()))
        if flush_s != "default":
            env["TRACEML_FLUSH_S"] = flush_s
        app = make_app(db)
        cpu_d0 = _cpu_s(daemon.proc.pid)
        rank_cpu: dict[int, float] = {}
        t0 = time.monotonic()

        async def drive() -> subprocess.Popen[str]:
            async with app.run_test(size=(160, 50)) as pilot:
                job = torchrun(__file__, ["--train", out, "--steps", str(steps), "--step-ms", str(step_ms)],
                               nproc=ranks, env=env, background=True)
                while job.poll() is None:
                    for child in psutil.Process(job.pid).children(recursive=True):
                        try:
                            t = child.cpu_times()
                            rank_cpu[child.pid] = t.user + t.system
                        except psutil.Error:
                            pass
                    await pilot.pause(0.5)
                await pilot.pause(2.0)  # the last flush reaches the screen
            return job

        job = asyncio.run(drive())
        wall = time.monotonic() - t0
        cpu_d = _cpu_s(daemon.proc.pid) - cpu_d0
        poller.stop()
        proxy.stop()
    log = job.stdout.read() if job.stdout else ""
    if job.returncode != 0:
        raise SystemExit(f"training job failed ({job.returncode}):\n{log[-4000:]}")
    run = Run(seconds=wall, agent_batches=proxy.agent_batches, forwarding_s=proxy.span[1] - proxy.span[0],
              ranks=ranks)
    run.daemon_cpu_pct = 100.0 * cpu_d / wall
    run.ranks_cpu_pct = 100.0 * sum(rank_cpu.values()) / wall
    run.tui = {"refresh_s": app.refresh_s, "poll_s": getattr(app, "poll_s", app.refresh_s),
               "refreshes_per_s": app.refresh_count / wall, "cost_s": getattr(app, "_last_cost_s", 0.0)}
    _collect(run, out, ranks, proxy, poller, app.paints)
    return run


def _collect(run: Run, out: str, ranks: int, proxy: FrameProxy, poller: CommitPoller, paints: list[Any]) -> None:
    names = ("agent_flush_wait", "relay", "daemon_commit", "tui_wait", "tui_read_paint")
    run.parts = {n: [] for n in names}
    for rank in range(ranks):
        ends = json.loads(Path(out, f"rank{rank}.json").read_text())
        keys = sorted(k for k in poller.committed if k[0] == rank)
        if len(keys) != len(ends):
            print(f"  rank {rank}: {len(ends)} steps run, {len(keys)} stored; matching in order", file=sys.stderr)
        lo, hi = ends[0] + SETTLE_S, ends[-1] - SETTLE_S
        pi = 0
        for key, end in zip(keys, ends, strict=False):
            ts, committed = poller.committed[key]
            run.ts_vs_end.append(ts - end)
            while pi < len(paints) and paints[pi][2].get(rank, -1) < key[1]:
                pi += 1  # paints are in time order and a rank's shown step only grows
            if pi == len(paints) or not lo <= end <= hi or key not in proxy.arrived:
                continue
            read_start, visible, _ = paints[pi]
            sent, arrived = proxy.arrived[key]
            run.latency.append(visible - end)
            for name, value in zip(
                names,
                (sent - end, arrived - sent, committed - arrived, read_start - committed, visible - read_start),
                strict=True,
            ):
                run.parts[name].append(value)
    run.steps = len(run.latency)


# ------------------------------------------------------------ report


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))] if s else float("nan")


def _line(name: str, xs: list[float]) -> str:
    return f"{name:<18} p50 {pct(xs, 0.5) * 1e3:7.0f}  p99 {pct(xs, 0.99) * 1e3:7.0f}  max {max(xs) * 1e3:7.0f} ms"


def report(label: str, runs: list[Run], flush: float, relay: float) -> dict[str, Any]:
    lat = [x for r in runs for x in r.latency]
    poll = runs[0].tui["poll_s"]
    ceiling = flush + relay + poll
    print(f"[{label}] {len(runs)} runs, {len(lat)} steps (first/last {SETTLE_S:.0f} s of each left out)")
    for i, r in enumerate(runs):
        print(f"[{label}] run {i + 1}: p50 {pct(r.latency, 0.5) * 1e3:.0f} ms  p99 {pct(r.latency, 0.99) * 1e3:.0f} ms  "
              f"max {max(r.latency) * 1e3:.0f} ms  ({r.steps} steps, relay p50 {pct(r.parts['relay'], 0.5) * 1e3:.0f} ms)")
    print(f"[{label}] " + _line("step end->visible", lat))
    for name in runs[0].parts:
        print(f"[{label}]   " + _line(name, [x for r in runs for x in r.parts[name]]))
    print(f"[{label}] baseline: polling ceiling = agent flush {flush:.2f} + relay packing {relay:.2f} + "
          f"TUI poll {poll:.2f} = {ceiling:.2f} s (same run's settings)")
    tui_rate = statistics.mean(r.tui["refreshes_per_s"] for r in runs)
    cost = statistics.mean(r.tui["cost_s"] for r in runs)
    print(f"[{label}] TUI: {tui_rate:.1f} refreshes/s; last read start to paint {cost * 1e3:.0f} ms")
    skew = [x for r in runs for x in r.ts_vs_end]
    print(f"[{label}] sanity: agent steps.ts - script end: median {statistics.median(skew) * 1e3:.2f} ms")
    wall = sum(r.seconds for r in runs)
    batches = sum(r.agent_batches for r in runs) / sum(r.forwarding_s for r in runs)
    dcpu = statistics.mean(r.daemon_cpu_pct for r in runs)
    rcpu = statistics.mean(r.ranks_cpu_pct for r in runs)
    print(f"[{label}] cost: {batches:.2f} agent batches/s reach the daemon ({batches / runs[0].ranks:.2f} "
          f"per rank); daemon CPU {dcpu:.2f}% of a core; training processes CPU {rcpu:.1f}% "
          f"(all ranks and the relay, over the whole run of {wall / len(runs):.0f} s incl. start-up)")
    return {
        "p50_ms": round(pct(lat, 0.5) * 1e3, 1),
        "p99_ms": round(pct(lat, 0.99) * 1e3, 1),
        "max_ms": round(max(lat) * 1e3, 1),
        "run_p99_ms": [round(pct(r.latency, 0.99) * 1e3, 1) for r in runs],
        "steps": len(lat),
        **{f"{n}_p50_ms": round(pct([x for r in runs for x in r.parts[n]], 0.5) * 1e3, 1) for n in runs[0].parts},
        **{f"{n}_p99_ms": round(pct([x for r in runs for x in r.parts[n]], 0.99) * 1e3, 1) for n in runs[0].parts},
        "polling_ceiling_ms": round(ceiling * 1e3, 1),
        "tui_refreshes_per_s": round(tui_rate, 2),
        "agent_batches_per_s": round(batches, 2),
        "daemon_cpu_pct": round(dcpu, 2),
        "ranks_cpu_pct": round(rcpu, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=20.0, help="training time per run (about)")
    ap.add_argument("--step-ms", type=float, default=50.0, help="sleep inside each step")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--flush-s", default="default", help="comma list of TRACEML_FLUSH_S values; 'default' = unset")
    ap.add_argument("--train", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.train:
        train(ns.train, ns.steps, ns.step_ms)
        return
    from agent.config import DEFAULT_FLUSH_S
    from relay.upstream import DEFAULT_FLUSH_INTERVAL

    steps = max(50, int(ns.seconds * 1e3 / (ns.step_ms + 5)))
    results: dict[str, Any] = {}
    for flush in ns.flush_s.split(","):
        label = f"flush {flush}"
        runs = []
        for _ in range(ns.runs):
            with tempfile.TemporaryDirectory() as tmp:
                runs.append(one_run(tmp, ns.ranks, steps, ns.step_ms, flush))
        f = DEFAULT_FLUSH_S if flush == "default" else float(flush)
        results[f"flush_{flush}"] = report(label, runs, f, DEFAULT_FLUSH_INTERVAL)
    first = next(iter(results.values()))
    print(json.dumps({"p50_ms": first["p50_ms"], "p99_ms": first["p99_ms"], "max_ms": first["max_ms"], **results}))


if __name__ == "__main__":
    main()
