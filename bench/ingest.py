"""Daemon ingest through relays into SQLite, against a plain sqlite3 baseline.

R simulated ranks behind K relay processes (K = R/8 by default) speak the real
wire protocol over real sockets to a real ``traceml-daemon serve``: each relay
process does the relay handshake, packs its ranks' rows as agent batch bodies
(columnar msgpack) the way real agents fill their flushes (steps with their
memory columns, process, status, the loss counters on the agent's schedule,
and host and GPU rows from each node's local rank 0: ``AgentMix``), forwards them in
numbered rbatches and reads the daemon's acks, which the daemon sends only
after the rows are committed. Two modes per R:

* ``throughput``: every relay sends as fast as its socket takes the bytes;
  reports stored step rows/s end to end and the send-to-stored latency (p50,
  p99). One case per ``--steps-per-flush`` value (default 10 and 3333: a rank
  at 100 ms steps and one at 0.3 ms steps, each flushing once a second): part
  of the daemon's cost is per flush (unpacking a body, dedup, a ranks, process
  and status row), part per step row, so the two bound the range. The real
  relay (relay/upstream.py) does not wait for acks before sending on; it keeps
  what is unacknowledged (up to 256 MiB) and is paced by the daemon's
  backpressure (the bounded queue pauses reading, TCP then blocks the relay's
  send). A bench relay keeps up to ``--window`` rbatches unacknowledged
  (default: its share of ``WINDOW_ROWS`` step rows over all the relays, at
  least 2: enough to keep the daemon saturated, so the rate is the daemon's
  capacity, while the run still drains in seconds; 0 removes the cap, and then
  every socket buffer fills and a 1024-rank case takes minutes to drain). Latency at saturation is mostly
  time queued. A small window measures the ack round trip instead;
* ``paced``: every rank flushes once per second (the agent's default) for a
  while; reports the daemon's CPU (% of one core) and peak RSS.

Baseline, same run, same rows: a plain ``sqlite3`` ``executemany`` of the
same step rows into the same schema (WAL, transactions of ``BASELINE_TXN_ROWS``
rows), in the order the daemon gets them: flush after flush, each rank's steps
together (``baseline_rows``). Order is part of the workload: the
``(rank_id, step)`` index takes rows whose rank changes every row 1.4x slower
than runs of one rank's steps in 32,768-row transactions, 2.5-3x slower in
5,120-row ones. (Until 2026-11-26 the baseline did both: rank ids cycling over
4096 every row, 5,120-row transactions, 130-170k rows/s against 450-530k for
the rows the daemon gets, so the ratios it printed were flattered ~3x.) A
paced case divides its step rate by that rate: the share of a core that just
inserting its step rows takes, the floor under the daemon's CPU figure. Every
case splits the daemon's CPU by thread: the event loop, the database thread
and the rest. Their sum near 100% means the GIL, not the cores, is the limit.

    python bench/ingest.py                    # R = 64, 1024, 4096
    python bench/ingest.py --ranks 64 --seconds 5
    python bench/ingest.py --ranks 4096 --modes paced --relays 64 --seconds 60

Paced cases also print the daemon's RSS every ``--rss-every`` seconds, split
into anonymous and file-backed memory (``/proc/PID/smaps_rollup``): a number
still rising at the end of a run is growth, not a peak. They print the daemon's
CPU per interval too: at thousands of ranks it rises over the first minute and
then holds, so a short run's average understates the steady state; read the late
intervals (``bench/walpages.py`` shows which index pages a commit writes).

Ends with one JSON line holding every figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import random
import resource
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402

from agent.batch import COUNTERS_REFRESH_FLUSHES  # noqa: E402
from traceml_daemon.net import memdebug  # noqa: E402
from traceml_daemon.store.migrate import migrate  # noqa: E402
from traceml_daemon.store.policy import DEFAULT_POLICY  # noqa: E402
from traceml_daemon.store.schema import PRAGMAS  # noqa: E402
from traceml_wire import FrameDecoder, encode_frame, unpack_message  # noqa: E402
from traceml_wire import messages as m  # noqa: E402
from traceml_wire.auth import hello_mac  # noqa: E402
from traceml_wire.body import encode_body  # noqa: E402
from traceml_wire.tables import columns  # noqa: E402

STEPS_PER_FLUSH = 10  # default: a rank doing 10 steps/s flushing once a second
# Throughput cases: a 100 ms-step rank's flush, and a 0.3 ms-step rank's (issue 5's
# fast loop). Which one a figure comes from matters: the daemon's cost is partly per
# flush (decode, dedup, a ranks row, a process and a status row), partly per step row.
THROUGHPUT_FLUSH_STEPS = (STEPS_PER_FLUSH, 3333)
SQLITE_PROBE_ROWS = 500_000  # baseline rows measured before each case (and after a paced one)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _step_rows(rank: int, first_step: int, n: int, rng: random.Random) -> list[dict]:
    now = time.time()
    rows = []
    for i in range(n):
        fwd, bwd, opt = rng.randint(4_000_000, 6_000_000), rng.randint(8_000_000, 12_000_000), 1_000_000
        dl, wait = rng.randint(100_000, 400_000), rng.randint(0, 2_000_000)
        rows.append({"step": first_step + i, "ts": now, "step_ns": fwd + bwd + opt + dl + wait,
                     "dataloader_ns": dl, "h2d_ns": 200_000, "forward_ns": fwd, "backward_ns": bwd,
                     "optimizer_ns": opt, "wait_ns": wait, "comm_ns": wait, "peak_bytes": 8 << 30,
                     "reserved_bytes": 10 << 30, "rss_bytes": 3 << 30, "model_id": 0,
                     # a DDP agent's rows: the FSDP2 columns travel empty (not measured)
                     "fwd_comm_ns": None, "bwd_comm_ns": None, "replicate_comm_ns": None,
                     "post_forward_bytes": None, "device_timed": 1})
    return rows


_POOL = 4096  # random step rows per worker, reused with advancing step numbers


# The loss counters a real agent reports (agent/rank_runtime.py and Tracer.counters on a GPU).
AGENT_COUNTERS = ("recorder_rows", "sender_batches", "sender_bytes", "agent_errors", "tracer_errors",
                  "device_steps_dropped", "device_steps_fallback", "device_steps_overflow", "steps_dropped",
                  "scalars_dropped", "events_exhausted")


@dataclasses.dataclass(frozen=True)
class AgentMix:
    """What a simulated agent's flush holds besides its steps, process and status rows,
    as a real agent's does: the loss counters (every ``counters_every``-th flush, from
    the first; 0: never) and, on each node's local rank 0, a host row and one row per GPU."""

    counters_every: int = COUNTERS_REFRESH_FLUSHES
    gpus_per_node: int = 8
    steps_per_flush: int = STEPS_PER_FLUSH
    # The WORLD_SIZE the simulated agents state, as real ones do from torchrun's (run_case
    # sets the case's rank count; the daemon sizes each rank's history sample by it).
    world_size: int = 0

    def describe(self) -> str:
        counters = "never" if not self.counters_every else (
            "every flush" if self.counters_every == 1 else f"every {self.counters_every} flushes")
        return (f"per rank-flush: {self.steps_per_flush} steps, 1 process, 1 status rows; {len(AGENT_COUNTERS)} counter "
                f"rows {counters}; local rank 0 also 1 system and {self.gpus_per_node} gpu rows")


class BodyMaker:
    """Agent batch bodies, cheap to make: the relay must not be what the benchmark
    measures (a real relay forwards bodies the agents packed, it never builds them)."""

    def __init__(self, rng: random.Random, mix: AgentMix) -> None:
        self.pool = max(_POOL, 2 * mix.steps_per_flush)
        rows = _step_rows(0, 0, self.pool, rng)
        self.cols = {c: [r[c] for r in rows] for c in columns("steps")}
        self.at = 0
        self.mix = mix

    def body(self, first_step: int, n: int, flush: int, leader: bool) -> bytes:
        """Rank's ``flush``-th body (from 0) of ``n`` steps; ``leader``: its node's local rank 0."""
        at = self.at = (self.at + n) % (self.pool - n)
        now = time.time()
        steps = {c: v[at:at + n] for c, v in self.cols.items()}
        steps["step"] = list(range(first_step, first_step + n))
        steps["ts"] = [now] * n
        tables = {
            "steps": steps,
            "process": {"ts": [now], "cpu_pct": [99.0], "rss_bytes": [3 << 30], "gpu_mem_bytes": [9 << 30],
                        "threads": [12]},
            "status": {"ts": [now], "phase": ["forward"], "phase_since": [now], "step": [first_step + n],
                       "steps_done": [first_step + n], "finished": [0]},
        }
        every = self.mix.counters_every
        if every and flush % every == 0:
            k = len(AGENT_COUNTERS)
            tables["drops"] = {"ts": [now] * k, "source": list(AGENT_COUNTERS), "count": [0] * k}
        if leader:
            tables["system"] = {"ts": [now], "cpu_pct": [55.0], "mem_used_bytes": [300 << 30],
                                "mem_total_bytes": [2048 << 30], "net_rx_bps": [1.2e9], "net_tx_bps": [1.1e9],
                                "disk_read_bps": [2.0e8], "disk_write_bps": [1.0e7]}
            g = self.mix.gpus_per_node
            if g:
                tables["gpu"] = {"ts": [now] * g, "gpu_index": list(range(g)), "util_pct": [97.0] * g,
                                 "mem_used_bytes": [70 << 30] * g, "mem_total_bytes": [80 << 30] * g,
                                 "temp_c": [65.0] * g, "power_w": [600.0] * g}
        return encode_body(tables, sent_ts=now)


def relay_worker(port: int, relays: list[tuple[int, list[int]]], mode: str, seconds: float, window: int,
                 out: mp.Queue, mix: AgentMix) -> None:
    """One process running several relays, one thread each: 512 relay processes
    would swamp a 2-core machine with interpreters instead of measuring the daemon."""
    import threading

    maker = BodyMaker(random.Random(relays[0][0]), mix)
    lock = threading.Lock()
    threads = [threading.Thread(target=relay_conn, args=(port, node, ranks, mode, seconds, window, out, maker, lock))
               for node, ranks in relays]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def relay_conn(port: int, node: int, ranks: list[int], mode: str, seconds: float, window: int,
               out: mp.Queue, maker: BodyMaker, lock: object) -> None:
    """One simulated relay: handshake, then numbered rbatches of its ranks' bodies."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    decoder = FrameDecoder()
    pending: list[dict] = []

    def read_messages(block: bool) -> list[dict]:
        sock.setblocking(block)
        try:
            data = sock.recv(1 << 16)
        except BlockingIOError:
            return []
        finally:
            sock.setblocking(True)
        if not data:
            raise ConnectionError("daemon closed the connection")
        return [unpack_message(b) for b in decoder.feed(data)]

    while not pending:
        pending = read_messages(True)
    nonce = pending.pop(0)["nonce"]
    sender = f"bench-relay-{node}-{os.getpid()}"
    sock.sendall(encode_frame(m.hello(role="relay", sender=sender, session="bench", identity={"node_rank": node},
                                      mac=hello_mac(None, nonce, "relay", sender))))
    reply = pending or read_messages(True)
    if reply[0]["t"] != "accept":
        raise SystemExit(f"refused: {reply[0]}")
    peers = {f"bench/r{r}": {"global_rank": r, "local_rank": r % 8, "node_rank": node, "world_size": maker.mix.world_size,
                             "hostname": f"node{node}"} for r in ranks}
    agent_seq = dict.fromkeys(ranks, 0)
    step = dict.fromkeys(ranks, 0)
    sent_at: dict[int, float] = {}
    latencies: list[float] = []
    seq = acked = rows = 0

    def take_acks(block: bool) -> None:
        """Read what the daemon sent (waiting for it when ``block``) and count its acks."""
        nonlocal acked
        for msg in read_messages(block):
            if msg["t"] == "ack":
                acked = _on_ack(msg["seq"], acked, sent_at, latencies)

    n = maker.mix.steps_per_flush
    deadline = time.monotonic() + seconds
    next_flush = time.monotonic()
    while time.monotonic() < deadline:
        if mode == "paced":
            wait = next_flush - time.monotonic()
            if wait > 0:
                take_acks(False)
                time.sleep(min(wait, 0.05))
                continue
            next_flush += 1.0
        elif window and seq - acked >= window:
            take_acks(True)
            continue
        elif seq > acked:  # take the acks that are in, without waiting (latency)
            take_acks(False)
        items = []
        for r in ranks:
            agent_seq[r] += 1
            with lock:  # type: ignore[attr-defined]
                body = maker.body(step[r], n, agent_seq[r] - 1, r % 8 == 0)
                items.append([f"bench/r{r}", agent_seq[r], body])
            step[r] += n
        seq += 1
        sock.sendall(encode_frame(m.relay_batch(seq, items, peers, {"node_rank": node}, {})))
        sent_at[seq] = time.monotonic()
        rows += len(ranks) * n
    # drain the remaining acks so every counted row is stored
    drain_deadline = time.monotonic() + 120
    while acked < seq and time.monotonic() < drain_deadline:
        take_acks(True)
    done_at = time.monotonic()
    sock.close()
    out.put({"rows": rows, "latencies": latencies, "done_at": done_at})


def _on_ack(seq: int, acked: int, sent_at: dict[int, float], latencies: list[float]) -> int:
    now = time.monotonic()
    for s in range(acked + 1, seq + 1):
        t = sent_at.pop(s, None)
        if t is not None:
            latencies.append(now - t)
    return max(acked, seq)


# Default throughput window: this many step rows unacknowledged over all the relays
# (each relay its share, in rbatches, at least 2): enough that the daemon's queue
# holds a few full transactions, so it stays saturated, and the run drains in a few
# seconds. (Until 2026-11-27 it was 5,120 rows per relay. At R=64 with 10 steps a
# flush, 41k rows in all, the daemon ran at 76-78% of a core and stored 103-107k
# rows/s, bound by the ack round trip; with this window 104% and 134k (half of it:
# 102%, 139k). At 512 relays the old rule put 2.6M rows in flight, tens of seconds
# to drain. Half this window saturated the daemon too, but at R=1024 stored 101k
# against 113-115k rows/s with this one or the old one: its transactions were not
# always full.)
WINDOW_ROWS = 327_680
BASELINE_MAX_ROWS = 1_000_000  # a throughput case's own rows, up to this many (memory)
BASELINE_TXN_ROWS = 32_768  # rows per baseline transaction: 5,120 gave ~390k rows/s, 20,480 ~480k, 81,920 ~490k


def baseline_rows(total_rows: int, ranks: int, steps_per_flush: int) -> list[tuple]:
    """The step rows of a case as the daemon receives them: flush after flush, every
    rank's ``steps_per_flush`` consecutive steps together (rank ids 1..R, as the
    daemon numbers them). The order matters for the ``(rank_id, step)`` index: rows
    whose rank changes every row touch a different index page each and insert 1.4x
    (32,768-row transactions) to 2.5-3x (5,120-row ones) slower than runs of one
    rank's steps, so a baseline in another order is a different workload."""
    rng = random.Random(0)
    pool = [tuple(r[c] for c in columns("steps")) for r in _step_rows(0, 0, 4096, rng)]
    out: list[tuple] = []
    first_step = at = 0
    while len(out) < total_rows:
        for rank in range(1, ranks + 1):
            for i in range(steps_per_flush):
                values = pool[at]
                at = (at + 1) % len(pool)
                out.append((rank, first_step + i, *values[1:]))
        first_step += steps_per_flush
    del out[total_rows:]
    return out


def sqlite_baseline(total_rows: int, tmp: Path, ranks: int, steps_per_flush: int) -> float:
    """Plain sqlite3 executemany of the same step rows into the same schema, in
    transactions of ``BASELINE_TXN_ROWS`` rows.

    The schema is the daemon's own (``migrate``: the current version, with its rank-group
    index on steps) and so are the connection settings (``PRAGMAS`` and the writer's
    cache and checkpoint sizes; its checkpoints run in the COMMITs that fill the WAL,
    as SQLite's automatic checkpoint does, where the daemon's run on a thread). Until
    2026-11-27 it was the version-1 schema, with the plain ``(rank_id, step)`` index,
    and default settings: the same rate within the noise
    (531-541k rows/s against 538-546k, 600,000 rows, 3 alternations), while the current
    schema with default settings was 5-15% slower (464-519k)."""
    db = tmp / "baseline.db"
    migrate(str(db))
    conn = sqlite3.connect(db)
    # A plain connection checkpoints inside its COMMITs, at the daemon's WAL cadence
    # (the daemon's checkpoints run on a thread of their own: store/checkpointer.py).
    inline = dataclasses.replace(DEFAULT_POLICY, checkpoint_interval_s=0)
    for pragma in (*PRAGMAS, *inline.writer_pragmas()):
        conn.execute(pragma)
    cols = ("rank_id",) + columns("steps")
    sql = f"INSERT INTO steps ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})"
    rows = baseline_rows(total_rows, ranks, steps_per_flush)
    batches = [rows[i:i + BASELINE_TXN_ROWS] for i in range(0, len(rows), BASELINE_TXN_ROWS)]
    start = time.perf_counter()
    for batch in batches:
        with conn:
            conn.executemany(sql, batch)
    elapsed = time.perf_counter() - start
    conn.close()
    db.unlink()
    return total_rows / elapsed


# Starts the real daemon CLI with IngestPolicy fields replaced (``--versus``): the
# policy module's default is swapped before the writer module binds it.
_DAEMON_WITH_POLICY = """
import dataclasses, json, sys
from traceml_daemon.store import policy
policy.DEFAULT_POLICY = dataclasses.replace(policy.DEFAULT_POLICY, **json.loads(sys.argv.pop(1)))
from traceml_daemon.commands.cli import main
sys.argv[0] = "traceml-daemon"
sys.exit(main())
"""


def _policy_overrides(pairs: list[str]) -> dict[str, int | float]:
    """``KEY=VALUE`` strings as IngestPolicy field replacements (numbers only)."""
    out: dict[str, int | float] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        out[key] = float(value) if "." in value else int(value)
    return out


def run_case(ranks: int, relays: int, mode: str, seconds: float, window: int | None, rss_every: float = 10.0,
             policy: dict[str, int | float] | None = None, mix: AgentMix | None = None) -> dict:
    mix = dataclasses.replace(mix or AgentMix(), world_size=ranks)
    if window is None:
        window = max(2, WINDOW_ROWS // (relays * mix.steps_per_flush * max(1, ranks // relays)))
    tmp = Path(tempfile.mkdtemp(prefix="traceml-ingest-"))
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    # The daemon's log goes to a file: an unread PIPE fills (64 KiB, one line per
    # connection) and then blocks the daemon's event loop on a log write.
    log_file = open(tmp / "daemon.log", "wb")  # noqa: SIM115 - closed after the daemon exits
    entry = ["-c", _DAEMON_WITH_POLICY, json.dumps(policy)] if policy else ["-m", "traceml_daemon"]
    # Every simulated relay connects from 127.0.0.1 at once: the per-address cap on
    # peers still in their hello is for real hosts, so it is lifted to the relay count.
    slots = str(relays + 64)
    daemon = subprocess.Popen([sys.executable, *entry, "serve", "--port", str(port), "--db",
                               str(tmp / "ingest.db"), "--max-connections", slots, "--max-unauthenticated", slots,
                               "--max-unauthenticated-per-address", slots], env=env,
                              stdout=subprocess.DEVNULL, stderr=log_file)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline or daemon.poll() is not None:
                raise SystemExit("daemon did not start") from None
            time.sleep(0.1)
    proc = psutil.Process(daemon.pid)
    proc.cpu_percent(None)
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()
    per = [(i, list(range(i, ranks, relays))) for i in range(relays)]
    nproc = min(relays, 4)
    workers = [ctx.Process(target=relay_worker, args=(port, per[i::nproc], mode, seconds, window, out, mix))
               for i in range(nproc)]
    cpu0 = proc.cpu_times()
    threads0 = _thread_cpu(proc)
    # The load generator's CPU (the relay worker processes, children of this one):
    # on a 2-core machine it competes with the daemon, where real relays run on
    # other nodes, so it is reported beside the daemon's.
    gen0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    for w in workers:
        w.start()
    peak_rss = 0
    results = []
    # (s, rss MB, anon MB, file MB, daemon CPU % of one core since the previous sample)
    timeline: list[tuple[float, float, float, float, float]] = []
    cpu_prev, t_prev = cpu0.user + cpu0.system, start
    next_sample = start + rss_every
    while len(results) < relays:
        try:
            results.append(out.get(timeout=0.25))
        except Exception:
            pass
        rss = proc.memory_info().rss
        peak_rss = max(peak_rss, rss)
        if time.monotonic() >= next_sample:
            next_sample += rss_every
            now, cpu = time.monotonic(), proc.cpu_times()
            cpu_now = cpu.user + cpu.system
            pct = 100 * (cpu_now - cpu_prev) / (now - t_prev)
            anon_kib, file_kib = memdebug.rss_split(daemon.pid)
            timeline.append((now - start, rss / 2**20, anon_kib / 1024, file_kib / 1024, pct))
            cpu_prev, t_prev = cpu_now, now
    end = max(r["done_at"] for r in results)
    cpu1 = proc.cpu_times()
    threads = _split_threads(daemon.pid, threads0, _thread_cpu(proc), end - start)
    for w in workers:
        w.join()
    gen1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # the workers only: the daemon still runs
    gen_cpu_s = (gen1.ru_utime + gen1.ru_stime) - (gen0.ru_utime + gen0.ru_stime)
    daemon.terminate()
    try:
        daemon.wait(60)
    except subprocess.TimeoutExpired:
        # Its shutdown (final history, summary) outlasting a minute must not cost the
        # case's figures, which are all taken by now; the log says what it was doing.
        print(f"  daemon still shutting down after 60 s: killed (log: {tmp / 'daemon.log'})", flush=True)
        daemon.kill()
        daemon.wait()
    log_file.close()
    rows = sum(r["rows"] for r in results)
    lat = sorted(x for r in results for x in r["latencies"])
    elapsed = end - start
    cpu_s = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    return {
        "ranks": ranks, "relays": relays, "mode": mode, "rows": rows, "steps_per_flush": mix.steps_per_flush, "seconds": elapsed,
        "rows_per_s": rows / elapsed,
        "latency_p50_ms": 1000 * lat[len(lat) // 2] if lat else None,
        "latency_p99_ms": 1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else None,
        "daemon_cpu_pct": 100 * cpu_s / elapsed, "daemon_peak_rss_mb": peak_rss / 2**20,
        "generator_cpu_pct": 100 * gen_cpu_s / elapsed,
        "rss_timeline": timeline, "tmp": str(tmp), **threads,
    }


def _thread_cpu(proc: psutil.Process) -> dict[int, float]:
    """CPU seconds so far of each of the process's threads."""
    try:
        return {t.id: t.user_time + t.system_time for t in proc.threads()}
    except psutil.Error:
        return {}


def _split_threads(pid: int, before: dict[int, float], after: dict[int, float], seconds: float) -> dict[str, float]:
    """The daemon's CPU by thread over a case, % of one core: the event loop (the main
    thread: reading, decoding, staging, aggregates), the busiest other thread
    (aiosqlite's database thread: binding, SQLite, the history fold) and the rest. The
    split shows which side of the GIL a change moved work to."""
    used = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    main = used.pop(pid, 0.0)
    busiest = max(used.values(), default=0.0)
    rest = sum(used.values()) - busiest
    return {"event_loop_cpu_pct": 100 * main / seconds, "db_thread_cpu_pct": 100 * busiest / seconds,
            "other_threads_cpu_pct": 100 * rest / seconds}


_THREAD_FIGURES = ("event_loop_cpu_pct", "db_thread_cpu_pct", "other_threads_cpu_pct")


def _thread_line(r: dict) -> str:
    return (f"  daemon CPU by thread: event loop {r['event_loop_cpu_pct']:.0f}%, database thread "
            f"{r['db_thread_cpu_pct']:.0f}%, others {r['other_threads_cpu_pct']:.0f}%")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="*", default=[64, 1024, 4096])
    p.add_argument("--seconds", type=float, default=8.0, help="sending time per case")
    p.add_argument("--window", type=int, default=None,
                   help="throughput mode: unacknowledged rbatches per relay at most (0: no cap, like the real relay; "
                        f"default: {WINDOW_ROWS} step rows' worth over all the relays, at least 2 each)")
    p.add_argument("--modes", nargs="*", default=["throughput", "paced"], choices=["throughput", "paced"])
    p.add_argument("--relays", type=int, default=None,
                   help="relays per case (default R/8; the design's 4096-rank scenario uses 64: docs/performance.md)")
    p.add_argument("--rss-every", type=float, default=10.0, help="seconds between RSS samples (paced)")
    p.add_argument("--versus", nargs="*", default=[], metavar="KEY=VALUE",
                   help="every case also runs, right before, with these IngestPolicy fields replaced "
                        "(a same-run baseline for a policy change, e.g. sqlite_cache_kib=2000)")
    p.add_argument("--versus-after", action="store_true",
                   help="run the --versus case right after the default one instead of before: a run in "
                        "each order tells a change from the machine drifting between the two")
    p.add_argument("--repeat", type=int, default=1,
                   help="run each case (and its --versus twin) this many times, each round with its own "
                        "baseline, and print medians with min..max: single runs of a case differ by up to "
                        "~15%% on a shared machine")
    p.add_argument("--keep-db", action="store_true",
                   help="keep each case's database and daemon log (removed after the case by default)")
    p.add_argument("--counters-every", type=int, default=COUNTERS_REFRESH_FLUSHES,
                   help="flushes between an agent's loss-counter rows (default: the agent's refresh, "
                        f"{COUNTERS_REFRESH_FLUSHES}; 1: every flush, as agents sent them before; 0: never)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="gpu rows in each node leader's flush")
    p.add_argument("--steps-per-flush", type=int, nargs="*", default=list(THROUGHPUT_FLUSH_STEPS),
                   help="throughput mode: one case per value, the step rows in each agent flush (an agent "
                        "flushes once a second, so its steps per second)")
    p.add_argument("--paced-steps-per-flush", type=int, default=STEPS_PER_FLUSH,
                   help="paced mode: step rows in each agent flush")
    p.add_argument("--versus-counters-every", type=int, default=None, metavar="N",
                   help="every case also runs, right before, with agents sending their counters every N flushes")
    args = p.parse_args()
    if args.repeat < 1:
        p.error(f"--repeat must be at least 1, got {args.repeat}")
    versus = _policy_overrides(args.versus)
    base_mix = AgentMix(args.counters_every, args.gpus_per_node)
    cases = [("throughput", n) for n in args.steps_per_flush if "throughput" in args.modes]
    cases += [("paced", args.paced_steps_per_flush)] if "paced" in args.modes else []
    figures: dict[str, float | None] = {}
    for ranks in args.ranks:
        relays = min(ranks, args.relays) if args.relays else max(1, ranks // 8)
        for mode, steps_per_flush in cases:
            mix = dataclasses.replace(base_mix, steps_per_flush=steps_per_flush)
            versus_mix = None if args.versus_counters_every is None else dataclasses.replace(
                mix, counters_every=args.versus_counters_every)
            versus_label = " ".join(filter(None, [f"{args.versus}" if versus else "",
                                                  versus_mix.describe() if versus_mix else ""]))
            print(f"agents: {mix.describe()}", flush=True)
            tag = f"r{ranks}_k{relays}_{mode}" if args.relays else f"r{ranks}_{mode}"
            if steps_per_flush != STEPS_PER_FLUSH:
                tag += f"_f{steps_per_flush}"
            compare = bool(versus or versus_mix)
            versus_args = (ranks, relays, mode, args.seconds, args.window, args.rss_every, versus or None,
                           versus_mix or mix)
            rounds: list[dict[str, float | None]] = []
            for round_no in range(args.repeat):
                if args.repeat > 1:
                    print(f"round {round_no + 1} of {args.repeat}", flush=True)
                one: dict[str, float | None] = {}
                before = _probe_baseline(ranks, mix.steps_per_flush)
                if compare and not args.versus_after:
                    versus_case = run_case(*versus_args)
                r = run_case(ranks, relays, mode, args.seconds, args.window, args.rss_every, mix=mix)
                if compare and args.versus_after:
                    versus_case = run_case(*versus_args)
                if mode == "throughput":
                    if compare:
                        _throughput_report(ranks, relays, f"{tag}_versus", versus_case, before, one,
                                           label=f" versus {versus_label}")
                    _throughput_report(ranks, relays, tag, r, before, one)
                else:
                    base = max(before, _probe_baseline(ranks, mix.steps_per_flush))
                    if compare:
                        _paced_report(ranks, relays, f"{tag}_versus", versus_case, base, one,
                                      label=f"versus {versus_label}")
                    _paced_report(ranks, relays, tag, r, base, one)
                rounds.append(one)
                # Each case's database and daemon log are hundreds of MB at 4096 ranks.
                for case in (r, versus_case) if compare else (r,):
                    if args.keep_db:
                        print(f"  kept {case['tmp']} (database and daemon.log)")
                    else:
                        shutil.rmtree(case["tmp"], ignore_errors=True)
            figures.update(rounds[-1] if len(rounds) == 1 else _rounds_summary(tag, mode, rounds, compare))
    print(json.dumps(figures))


# The figures a repeated case summarises: (suffix, label, format) per mode.
_SUMMARISED = {
    "throughput": (("rows_per_s", "step rows/s", ",.0f"), ("ratio", "ratio", ".2f")),
    "paced": (("cpu_pct", "daemon CPU % of a core", ".0f"), ("peak_rss_mb", "peak RSS MB", ".0f"),
              ("p99_ms", "p99 latency ms", ".0f")),
}


def _rounds_summary(tag: str, mode: str, rounds: list[dict[str, float | None]], compare: bool
                    ) -> dict[str, float | None]:
    """Medians over the rounds of a repeated case (``--repeat``), printed with their
    min..max; with ``--versus``, also the median of the per-round differences, each
    round's pair run back to back (the paired figure a drifting machine leaves alone)."""
    out: dict[str, float | None] = {}
    for key in rounds[-1]:  # every round's figures, kept per round
        for i, one in enumerate(rounds):
            out[f"{key}_round{i + 1}"] = one.get(key)
    for suffix, label, fmt in _SUMMARISED[mode]:
        for which in ([f"{tag}_versus", tag] if compare else [tag]):
            values = [v for v in (one.get(f"{which}_{suffix}") for one in rounds) if v is not None]
            if not values:
                continue
            median = statistics.median(values)
            out[f"{which}_{suffix}"] = median
            name = "versus" if which.endswith("_versus") else "this daemon"
            print(f"  {len(values)} rounds, {name}: {label} median {median:{fmt}} "
                  f"(min {min(values):{fmt}}, max {max(values):{fmt}})")
        if compare:
            diffs = [one[f"{tag}_{suffix}"] - one[f"{tag}_versus_{suffix}"] for one in rounds  # type: ignore[operator]
                     if one.get(f"{tag}_{suffix}") is not None and one.get(f"{tag}_versus_{suffix}") is not None]
            if diffs:
                paired = out[f"{tag}_{suffix}_minus_versus_median"] = statistics.median(diffs)
                print(f"  this daemon minus versus, paired by round: {label} median {paired:+{fmt}} "
                      f"(min {min(diffs):+{fmt}}, max {max(diffs):+{fmt}})")
    return out


def _probe_baseline(ranks: int, steps_per_flush: int) -> float:
    """The plain sqlite3 rate of ``SQLITE_PROBE_ROWS`` step rows, in a scratch directory."""
    probe_dir = Path(tempfile.mkdtemp(prefix="traceml-base-"))
    try:
        return sqlite_baseline(SQLITE_PROBE_ROWS, probe_dir, ranks, steps_per_flush)
    finally:
        shutil.rmtree(probe_dir, ignore_errors=True)


def _throughput_report(ranks: int, relays: int, tag: str, r: dict, before: float, figures: dict,
                       label: str = "") -> None:
    # The machine is shared: measure the baseline right before and right after the
    # case and divide by the faster, so a quiet moment for the baseline can only
    # lower the ratio, never flatter it.
    base = max(before, sqlite_baseline(min(r["rows"], BASELINE_MAX_ROWS), Path(r["tmp"]), ranks,
                                           r["steps_per_flush"]))
    ratio = r["rows_per_s"] / base
    print(f"R={ranks:5d} K={relays:4d} throughput{label}: {r['rows_per_s']:,.0f} step rows/s stored end to end; "
          f"baseline plain sqlite3 executemany {base:,.0f} rows/s; ratio {ratio:.2f}; "
          f"latency p50 {r['latency_p50_ms']:.1f} ms p99 {r['latency_p99_ms']:.1f} ms; "
          f"daemon CPU {r['daemon_cpu_pct']:.0f}%, peak RSS {r['daemon_peak_rss_mb']:.0f} MB; "
          f"load generator (relay processes) CPU {r['generator_cpu_pct']:.0f}%")
    print(_thread_line(r))
    figures.update({f"{tag}_rows_per_s": r["rows_per_s"], f"{tag}_sqlite_rows_per_s": base,
                    f"{tag}_ratio": ratio, f"{tag}_p50_ms": r["latency_p50_ms"],
                    f"{tag}_p99_ms": r["latency_p99_ms"], f"{tag}_peak_rss_mb": r["daemon_peak_rss_mb"],
                    f"{tag}_daemon_cpu_pct": r["daemon_cpu_pct"], f"{tag}_generator_cpu_pct": r["generator_cpu_pct"],
                    **{f"{tag}_{k}": r[k] for k in _THREAD_FIGURES}})


def _paced_report(ranks: int, relays: int, tag: str, r: dict, base: float, figures: dict, label: str = "") -> None:
    tl = r["rss_timeline"]
    # The same-run baseline of the CPU figure: a core's share that a plain sqlite3
    # executemany of just these step rows takes (the faster of a probe before and after
    # the case), with no decoding, process rows, history or aggregates.
    floor_pct = 100 * r["rows_per_s"] / base
    # The CPU climbs for the first ~60 s (see the docstring): the second half of the
    # intervals is the steady state a long run lives in, so it is reported too.
    late = [pct for _, _, _, _, pct in tl[len(tl) // 2:]]
    late_cpu = sum(late) / len(late) if late else None
    print(f"R={ranks:5d} K={relays:4d} paced 1 flush/s/rank{' ' + label if label else ''}: "
          f"{r['rows_per_s']:,.0f} step rows/s; daemon CPU {r['daemon_cpu_pct']:.0f}% of one core "
          f"(second half {late_cpu if late_cpu is None else round(late_cpu)}%), "
          f"peak RSS {r['daemon_peak_rss_mb']:.0f} MB; "
          f"latency p50 {r['latency_p50_ms']:.1f} ms p99 {r['latency_p99_ms']:.1f} ms; "
          f"load generator CPU {r['generator_cpu_pct']:.0f}%")
    print(_thread_line(r))
    print(f"  baseline: plain sqlite3 executemany of the same step rows alone takes {floor_pct:.1f}% of one core "
          f"({base:,.0f} rows/s, same run)")
    print("  RSS over time (s: total MB = anon + file): " + ", ".join(
        f"{t:.0f}: {rss:.0f} = {anon:.0f} + {file:.0f}" for t, rss, anon, file, _ in tl))
    print("  daemon CPU % of one core per interval (s: %): " + ", ".join(f"{t:.0f}: {pct:.0f}" for t, *_, pct in tl))
    figures.update({f"{tag}_rows_per_s": r["rows_per_s"], f"{tag}_cpu_pct": r["daemon_cpu_pct"],
                    f"{tag}_late_cpu_pct": late_cpu, f"{tag}_peak_rss_mb": r["daemon_peak_rss_mb"],
                    f"{tag}_end_rss_mb": tl[-1][1] if tl else None,
                    f"{tag}_p50_ms": r["latency_p50_ms"], f"{tag}_p99_ms": r["latency_p99_ms"],
                    f"{tag}_generator_cpu_pct": r["generator_cpu_pct"],
                    f"{tag}_sqlite_rows_per_s": base, f"{tag}_sqlite_floor_cpu_pct": floor_pct,
                    **{f"{tag}_{k}": r[k] for k in _THREAD_FIGURES}})


if __name__ == "__main__":
    main()
