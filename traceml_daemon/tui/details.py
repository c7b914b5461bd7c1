"""The node and rank screens' view models, built from the read layer.

``TuiData`` keeps the ranks' live state and calls these for the screen that
is open; the series they draw are cached buckets (``store.read.series``), so a
refresh only aggregates the steps written since the previous one.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from traceml_daemon.analysis.model import PHASES
from traceml_daemon.store.read import detail, fsdp2, samples
from traceml_daemon.store.read.rollouts import run_profiles
from traceml_daemon.store.read.series import Buckets, Series, scalar_buckets, step_buckets
from traceml_daemon.tui.model import (
    GpuLatest,
    LayerRow,
    ModelRow,
    NodeDetail,
    ProcessLatest,
    RankDetail,
    SystemLatest,
)
from traceml_daemon.tui.ranks import LiveRank

NODE_SPARK_RANKS = 64  # step sparklines drawn on a node screen; the screen says when there are more
GPU_SCAN_ROWS = 256  # newest GPU rows searched for each GPU's latest sample (8 GPUs x 32 samples)
MEMORY = (("peak", "peak_bytes"), ("reserved", "reserved_bytes"), ("rss", "rss_bytes"))


class SeriesCache:
    """Bucketed series by key, each brought up to date when asked for."""

    def __init__(self, con: sqlite3.Connection, width: int) -> None:
        self.con = con
        self.width = width
        self._buckets: dict[Hashable, Buckets] = {}

    def get(self, key: Hashable, make: Callable[[int], Buckets]) -> Buckets:
        """The buckets under ``key`` (``make(width)`` the first time), updated."""
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = make(self.width)
        b.update(self.con)
        return b

    def clear(self) -> None:
        self._buckets = {}

    def step_ms(self, rank_id: int) -> Series:
        """A rank's step time (ms) over the run."""
        return self.get(("steps", rank_id), lambda w: step_buckets(rank_id, ("step_ns",), w)).series(0, 1e-6)


def _ms(ns: float | None) -> float | None:
    return None if ns is None else ns / 1e6


def node_detail(con: sqlite3.Connection, cache: SeriesCache, node_rank: int, ranks: Sequence[LiveRank]) -> NodeDetail:
    """The node screen: ``ranks`` are the node's, by global rank (at least one)."""
    # One bucketed series per rank: bounded so a 512-rank node stays one quick read;
    # NodeDetail.ranks still lists them all and the screen says how many have a line.
    sparks = {r.global_rank: cache.step_ms(r.rank_id) for r in ranks[:NODE_SPARK_RANKS]}
    system: SystemLatest | None = None
    gpus: list[GpuLatest] = []
    for r in ranks:  # the host sampler runs on the node's local rank 0; find whoever sent rows
        if system is None:
            rows = samples.host_samples(con, r.rank_id, cache.width)
            if rows:
                lt = rows[-1]
                system = SystemLatest(
                    cpu_pct=lt[1],
                    mem_used_bytes=lt[2],
                    mem_total_bytes=lt[3],
                    net_rx_bps=lt[4],
                    net_tx_bps=lt[5],
                    cpu_series=Series([x[0] for x in rows], [x[1] for x in rows]),
                )
        if not gpus:
            gpus = [GpuLatest(*g) for g in samples.latest_gpus(con, r.rank_id, GPU_SCAN_ROWS)]
    return NodeDetail(node_rank, ranks[0].hostname, [r.row() for r in ranks], sparks, system, gpus)


def rank_detail(con: sqlite3.Connection, cache: SeriesCache, rank: LiveRank) -> RankDetail:
    rid = rank.rank_id
    phase_cols = [f"{p}_ns" for p in PHASES]
    pb = cache.get(("phases", rid), lambda w: step_buckets(rid, phase_cols, w))
    mb = cache.get(("mem", rid), lambda w: step_buckets(rid, [col for _, col in MEMORY], w))
    proc = samples.process_samples(con, rid, cache.width)
    process = None
    if proc:
        lt = proc[-1]
        process = ProcessLatest(lt[1], lt[2], lt[3], lt[4], Series([r[0] for r in proc], [r[1] for r in proc]))
    scalars: dict[str, tuple[float | None, Series]] = {}
    for name in detail.scalar_names(con, rid):
        sb = cache.get(("scalar", rid, name), lambda w, name=name: scalar_buckets(rid, name, w))
        scalars[name] = (detail.latest_scalar(con, rid, name), sb.series(0))
    layers_step, layer_rows = detail.latest_layers(con, rid)
    models: dict[Any, ModelRow] = {}
    for row in detail.model_reports(con, rid):
        models[row[0]] = ModelRow(*row)  # latest report of each model wins
    return RankDetail(
        row=rank.row(),
        phase_series={p: pb.series(i, 1e-6) for i, p in enumerate(PHASES)},
        memory_series={name: mb.series(i) for i, (name, _) in enumerate(MEMORY)},
        process=process,
        scalars=scalars,
        layers_step=layers_step,
        layers=[LayerRow(r[0], _ms(r[1]), _ms(r[2]), r[3]) for r in layer_rows],
        models=[models[k] for k in sorted(models, key=lambda x: (x is None, x))],
        fsdp2=fsdp2.recent_view(con, rid),
        profiles=[(p.step, p.steps, p.path) for p in run_profiles(con, [(rid, None)])],
    )
