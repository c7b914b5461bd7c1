"""Per-rank rolling windows over the latest steps, kept up to date as batches land.

Live views (diagnosis, TUI, metrics) need "median step time of rank r over the
last N steps" every refresh; rescanning SQLite for it would grow with the run.
Instead the writer pushes each committed batch of step columns here: a
fixed-size ring per series, so memory is O(ranks x N) and a median costs
O(N log N) on demand.

Pushing is O(1) (the columns are kept as they are); they are folded into the
windows when a view is read, or once a rank holds a window's worth, so the
ingest path pays one fold per rank per read (or per N steps), not one per
committed transaction, and memory stays bounded when nobody reads.

Medians are cached per rank and recomputed only for ranks that received steps
since the last snapshot, so a refresh with 1024 ranks where a few moved costs
a few sorts. ``live()`` adds per-node views (median of the node's rank medians,
its worst rank) and skews: how far the worst rank / node is above the median
one, the numbers straggler diagnosis and the TUI header show.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from traceml_daemon.analysis.nodes import by_node_with_worst, worst_key

# The window itself is pure and shared with the TUI: it lives in analysis.rolling.
from traceml_daemon.analysis.rolling import DEFAULT_WINDOW, FOLD_ROWS, STEP_COLUMNS, RankWindow
from traceml_wire.tables import PHASES, Column

__all__ = ["DEFAULT_WINDOW", "FOLD_ROWS", "STEP_COLUMNS", "Aggregates", "LiveSnapshot", "NodeSnapshot",
           "RankSnapshot", "RankWindow"]


@dataclass
class RankSnapshot:
    rank_id: int
    global_rank: int | None
    node_rank: int | None
    steps_seen: int
    last_step: int | None
    last_ts: float | None
    step_ms_median: float | None
    phases_ms_median: dict[str, float | None]
    busy_ms_median: float | None = None  # step minus wait where wait is measured, else step


class Aggregates:
    """Rolling windows for every rank the daemon has stored steps for."""

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        self.window = window
        self._ranks: dict[int, RankWindow] = {}

    def add_steps(
        self, rank_id: int, cols: dict[str, list[Any]], *, global_rank: int | None = None, node_rank: int | None = None
    ) -> None:
        self._window(rank_id, global_rank, node_rank).push(cols)

    def add_batches(
        self,
        rank_id: int,
        batches: Sequence[Sequence[Column]],
        *,
        global_rank: int | None = None,
        node_rank: int | None = None,
    ) -> None:
        """Like ``add_steps`` for decoded step batches (columns in ``STEP_COLUMNS`` order):
        the writer's path, one call per rank and transaction."""
        self._window(rank_id, global_rank, node_rank).push_batches(batches)

    def _window(self, rank_id: int, global_rank: int | None, node_rank: int | None) -> RankWindow:
        """The rank's window (created on first sight), its identity updated where known."""
        rank = self._ranks.get(rank_id)
        if rank is None:
            rank = self._ranks[rank_id] = RankWindow(rank_id, window=self.window)
        if global_rank is not None:
            rank.global_rank = global_rank
        if node_rank is not None:
            rank.node_rank = node_rank
        return rank

    def snapshot(self) -> list[RankSnapshot]:
        """Medians of every rank's current window, ordered by global rank."""
        out = []
        for r in self._ranks.values():
            r.fold()
            step_med, phase_med, busy_med = r.medians()
            out.append(
                RankSnapshot(
                    rank_id=r.rank_id,
                    global_rank=r.global_rank,
                    node_rank=r.node_rank,
                    steps_seen=r.steps_seen,
                    last_step=r.last_step,
                    last_ts=r.last_ts,
                    step_ms_median=step_med,
                    phases_ms_median=dict(phase_med),
                    busy_ms_median=busy_med,
                )
            )
        out.sort(key=lambda s: (s.global_rank is None, s.global_rank or 0, s.rank_id))
        return out

    def live(self) -> LiveSnapshot:
        """Ranks, nodes and skews from the rolling windows; no database access."""
        ranks = self.snapshot()
        nodes = []
        for node_rank, members, worst in by_node_with_worst(
            ranks, lambda r: r.node_rank, lambda r: r.step_ms_median, lambda r: r.busy_ms_median
        ):
            timed = [r for r in members if r.step_ms_median is not None]
            nodes.append(
                NodeSnapshot(
                    node_rank=node_rank,
                    ranks=[_label(r) for r in members],
                    steps_seen=sum(r.steps_seen for r in members),
                    last_step=max((r.last_step for r in members if r.last_step is not None), default=None),
                    step_ms_median=_median([_step_ms(r) for r in timed]),
                    phases_ms_median={
                        p: _median([v for r in members if (v := r.phases_ms_median.get(p)) is not None]) for p in PHASES
                    },
                    worst_rank=_label(worst) if worst else None,
                    worst_step_ms=_step_ms(worst) if worst else None,
                    skew=_skew([_step_ms(r) for r in timed]),
                )
            )
        timed = [r for r in ranks if r.step_ms_median is not None]
        worst = max(timed, key=_worst_key) if timed else None
        node_meds = [n.step_ms_median for n in nodes if n.step_ms_median is not None]
        worst_node = max((n for n in nodes if n.step_ms_median is not None), key=lambda n: n.step_ms_median or 0.0,
                         default=None)
        return LiveSnapshot(
            ranks=ranks,
            nodes=nodes,
            step_ms_median=_median([_step_ms(r) for r in timed]),
            worst_rank=_label(worst) if worst else None,
            worst_step_ms=_step_ms(worst) if worst else None,
            rank_skew=_skew([_step_ms(r) for r in timed]),
            worst_node=worst_node.node_rank if worst_node else None,
            node_skew=_skew(node_meds),
        )


@dataclass
class NodeSnapshot:
    node_rank: int
    ranks: list[int]
    steps_seen: int
    last_step: int | None
    step_ms_median: float | None  # median of the node's rank medians
    phases_ms_median: dict[str, float | None]
    worst_rank: int | None
    worst_step_ms: float | None
    skew: float | None  # (worst - median) / median over the node's ranks


@dataclass
class LiveSnapshot:
    ranks: list[RankSnapshot]
    nodes: list[NodeSnapshot]
    step_ms_median: float | None  # median over ranks of their median step time
    worst_rank: int | None
    worst_step_ms: float | None
    rank_skew: float | None  # (worst rank - median rank) / median rank
    worst_node: int | None
    node_skew: float | None  # (worst node - median node) / median node


def _step_ms(r: RankSnapshot) -> float:
    return r.step_ms_median if r.step_ms_median is not None else 0.0


def _worst_key(r: RankSnapshot) -> tuple[float, float]:
    return worst_key(r.step_ms_median, r.busy_ms_median)


def _label(r: RankSnapshot) -> int:
    return r.global_rank if r.global_rank is not None else -r.rank_id


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _skew(values: list[float]) -> float | None:
    if len(values) < 2:
        return None
    mid = statistics.median(values)
    return (max(values) - mid) / mid if mid > 0 else None
