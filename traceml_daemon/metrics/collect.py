"""Build a ``MetricsSnapshot`` from the running daemon, off the ingest hot path.

Two sources, chosen by cost:

* live and cheap, read at every scrape: the writer's rolling windows
  (``Aggregates``: per-rank step and phase medians, steps seen) and the
  daemon's delivery ``Counters``;
* from the database, read-only in a worker thread and cached for
  ``refresh_s``: rank identity (session, node, rank labels), the latest host
  and GPU sample per node, relay counters, the current verdicts (under the
  daemon's ``--policy``) and the database's size. A scrape
  therefore never blocks the event loop, and the writer never pays for it.

Only sessions this daemon process has stored steps for are exposed, so a
daemon restarted on an old database does not publish a finished run as live.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from traceml_daemon.analysis.policy import Policy
from traceml_daemon.ingest.counters import Counters
from traceml_daemon.ingest.live import Aggregates, RankSnapshot
from traceml_daemon.metrics.exposition import GpuMetrics, MetricsSnapshot, NodeMetrics, RankMetrics, VerdictMetric
from traceml_daemon.store import reader
from traceml_daemon.store.read import samples

log = logging.getLogger("traceml_daemon.metrics.exposition")

VERDICT_WINDOW = 200  # steps per rank handed to the diagnosis, like the live TUI
GPU_SCAN_ROWS = 64  # newest GPU rows searched for each GPU's latest sample
_UNKNOWN = "unknown"


@dataclass(frozen=True)
class _Identity:
    session: str
    attempt: int
    node: str
    rank: str


@dataclass
class _DbState:
    identity: dict[int, _Identity] = field(default_factory=dict)  # rank_id -> labels
    nodes: list[NodeMetrics] = field(default_factory=list)
    verdicts: list[VerdictMetric] = field(default_factory=list)
    relay: dict[str, int] = field(default_factory=dict)
    rows_dropped_reported: int = 0  # rows agents reported lost, summed
    batches_dropped_reported: int = 0  # batches agents and relays reported lost, summed
    database: dict[str, int] = field(default_factory=dict)  # gauge name -> bytes (database_bytes)


def _label(value: int | None) -> str:
    return _UNKNOWN if value is None else str(value)


def _nodes(conn: sqlite3.Connection, session: str, ranks: list[reader.RankRow]) -> list[NodeMetrics]:
    """Latest host/GPU sample per node; only local rank 0 samples the host."""
    best: dict[str, tuple[float, NodeMetrics]] = {}
    for rank in ranks:
        if rank.local_rank not in (0, None):
            continue
        node = _label(rank.node_rank)
        system = samples.latest_host_sample(conn, rank.rank_id)
        gpus = [GpuMetrics(str(g[0]), *g[1:]) for g in samples.latest_gpus(conn, rank.rank_id, GPU_SCAN_ROWS)]
        if system is None and not gpus:
            continue
        ts = (system[0] if system else None) or 0.0
        metrics = NodeMetrics(session=session, node=node, hostname=rank.hostname, gpus=gpus)
        if system is not None:
            metrics.cpu_pct, metrics.mem_used_bytes, metrics.mem_total_bytes = system[1], system[2], system[3]
        if node not in best or ts >= best[node][0]:
            best[node] = (ts, metrics)
    return [best[k][1] for k in sorted(best)]


def database_bytes(conn: sqlite3.Connection, db_path: str) -> dict[str, int]:
    """What the database takes: its files on disk (with the WAL) and the pages in use, which
    retention's size cap counts (freed pages are reused, so the file does not shrink)."""
    pages, free, size = (
        int(conn.execute(f"PRAGMA {p}").fetchone()[0]) for p in ("page_count", "freelist_count", "page_size")
    )
    on_disk = 0
    for path in (db_path, db_path + "-wal"):
        try:
            on_disk += os.path.getsize(path)
        except OSError:
            pass  # no WAL right after a checkpoint truncated it, or the file went: not an error of the scrape
    return {"database_size_bytes": on_disk, "database_used_bytes": (pages - free) * size}


def _verdicts(
    conn: sqlite3.Connection, run: reader.RunRef, ranks: list[reader.RankRow], policy: Policy | None = None
) -> list[VerdictMetric]:
    try:
        from traceml_daemon.analysis.engine import diagnose

        data = reader.load_run(conn, run, last_n=VERDICT_WINDOW, live=True)
        verdicts = diagnose(data, policy)
    except Exception:
        # The diagnosis must never cost the user the rest of the scrape.
        log.exception("diagnosis for /metrics failed")
        return []
    node_of_rank = {r.global_rank: r.node_rank for r in ranks}
    out: list[VerdictMetric] = []
    for v in verdicts:
        rank = v.scope.get("global_rank")
        node = v.scope.get("node_rank", node_of_rank.get(rank) if rank is not None else None)
        out.append(
            VerdictMetric(
                session=run.session,
                name=v.name,
                severity=v.severity,
                node=None if node is None else str(node),
                rank=None if rank is None else str(rank),
            )
        )
    return out


def read_db_state(db_path: str, live_rank_ids: set[int], policy: Policy | None = None) -> _DbState:
    """Everything the scrape needs from SQLite (runs in a worker thread)."""
    state = _DbState()
    conn = reader.open_readonly(db_path)
    try:
        state.database = database_bytes(conn, db_path)
        runs: dict[str, int] = {}  # session -> newest attempt among the live ranks
        for rank in reader.all_ranks(conn):
            if rank.rank_id not in live_rank_ids:
                continue
            attempt = int(rank.attempt or 0)
            state.identity[rank.rank_id] = _Identity(rank.session, attempt, _label(rank.node_rank), _label(rank.global_rank))
            runs[rank.session] = max(runs.get(rank.session, 0), attempt)
        for session in sorted(runs):
            run = reader.RunRef(session, runs[session])
            ranks = reader.load_ranks(conn, run)
            state.nodes += _nodes(conn, session, ranks)
            state.verdicts += _verdicts(conn, run, ranks, policy)
        for name, value in reader.delivery_counters(conn).items():
            # agents_connected is a current count stored as a maximum: not a counter.
            if name.startswith("relay_") and name != "relay_agents_connected":
                state.relay[name.removeprefix("relay_")] = value
            elif name == "rows_dropped_reported":
                state.rows_dropped_reported = value
            elif name == "batches_dropped_reported":
                state.batches_dropped_reported = value
    finally:
        conn.close()
    return state


def _rank_metrics(ranks: list[RankSnapshot], identity: dict[int, _Identity]) -> list[RankMetrics]:
    # A torchelastic restart gives the same (session, node, rank) a new rank id:
    # keep the newest attempt so every label set appears once.
    chosen: dict[tuple[str, str, str], tuple[int, int, RankSnapshot]] = {}
    for snap in ranks:
        ident = identity.get(snap.rank_id)
        if ident is None:
            continue  # identity not read yet: the next refresh picks it up
        key = (ident.session, ident.node, ident.rank)
        order = (ident.attempt, snap.rank_id)
        if key not in chosen or order > chosen[key][:2]:
            chosen[key] = (*order, snap)
    return [
        RankMetrics(
            session=key[0],
            node=key[1],
            rank=key[2],
            steps_seen=snap.steps_seen,
            step_ms_median=snap.step_ms_median,
            phases_ms_median=dict(snap.phases_ms_median),
        )
        for key, (_a, _r, snap) in sorted(chosen.items())
    ]


class MetricsCollector:
    """Snapshots for ``/metrics``: live windows every scrape, the database at most every ``refresh_s``."""

    def __init__(
        self,
        db_path: str,
        aggregates: Aggregates,
        counters: Counters,
        refresh_s: float = 2.0,
        process_counters: Callable[[], dict[str, int]] | None = None,
        policy: Policy | None = None,
    ) -> None:
        self.db_path = db_path
        self.policy = policy  # the thresholds of serve --policy (None: the defaults)
        self.aggregates = aggregates
        self.counters = counters
        self.process_counters = process_counters  # the daemon process's own (WAL checkpoints)
        self.refresh_s = refresh_s
        self._db = _DbState()
        self._db_at: float | None = None
        self._db_ids: frozenset[int] = frozenset()
        self._lock = asyncio.Lock()

    async def _db_state(self, live_ids: frozenset[int]) -> _DbState:
        async with self._lock:  # concurrent scrapes share one refresh
            fresh = self._db_at is not None and time.monotonic() - self._db_at < self.refresh_s
            if fresh and live_ids <= self._db_ids:
                return self._db
            try:
                self._db = await asyncio.to_thread(read_db_state, self.db_path, set(live_ids), self.policy)
                self._db_ids = live_ids
            except (sqlite3.Error, reader.StoreError) as exc:
                log.warning("metrics: cannot read %s, serving the previous values: %s", self.db_path, exc)
            self._db_at = time.monotonic()
            return self._db

    async def snapshot(self) -> MetricsSnapshot:
        ranks = self.aggregates.snapshot()
        db = await self._db_state(frozenset(r.rank_id for r in ranks))
        return MetricsSnapshot(
            ranks=_rank_metrics(ranks, db.identity),
            nodes=db.nodes,
            verdicts=db.verdicts,
            delivery={
                **self.counters.as_dict(),
                "rows_dropped_reported": db.rows_dropped_reported,
                "batches_dropped_reported": db.batches_dropped_reported,
            },
            relay=db.relay,
            process=self.process_counters() if self.process_counters is not None else {},
            database=dict(db.database),
        )

    async def render(self) -> str:
        from traceml_daemon.metrics.exposition import render_openmetrics

        return render_openmetrics(await self.snapshot())
