"""Per-rank rolling windows over the latest steps, kept up to date as batches land.

Live views (diagnosis, TUI, metrics) need "median step time of rank r over the
last N steps" every refresh; rescanning SQLite for it would grow with the run.
Instead the writer pushes each committed step row here: a fixed-size deque per
series, so memory is O(ranks x N) and a median costs O(N log N) on demand.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from traceml_wire.tables import PHASES

DEFAULT_WINDOW = 200


@dataclass
class RankWindow:
    rank_id: int
    global_rank: int | None = None
    node_rank: int | None = None
    window: int = DEFAULT_WINDOW
    steps_seen: int = 0
    last_step: int | None = None
    last_ts: float | None = None
    step_ns: deque[int] = field(init=False)
    phases_ns: dict[str, deque[int]] = field(init=False)

    def __post_init__(self) -> None:
        self.step_ns = deque(maxlen=self.window)
        self.phases_ns = {p: deque(maxlen=self.window) for p in PHASES}

    def add(self, cols: dict[str, list[Any]]) -> None:
        steps = cols.get("step") or []
        for i, step in enumerate(steps):
            self.steps_seen += 1
            if isinstance(step, int) and (self.last_step is None or step >= self.last_step):
                self.last_step = step
                ts = cols.get("ts", [None] * len(steps))[i]
                if ts is not None:
                    self.last_ts = ts
            value = cols.get("step_ns", [None] * len(steps))[i]
            if value is not None:
                self.step_ns.append(value)
            for phase in PHASES:
                value = cols.get(f"{phase}_ns", [None] * len(steps))[i]
                if value is not None:
                    # "None" means not measured, so it stays out of the median.
                    self.phases_ns[phase].append(value)


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


def _median_ms(values: deque[int]) -> float | None:
    return statistics.median(values) / 1e6 if values else None


class Aggregates:
    """Rolling windows for every rank the daemon has stored steps for."""

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        self.window = window
        self._ranks: dict[int, RankWindow] = {}

    def add_steps(
        self, rank_id: int, cols: dict[str, list[Any]], *, global_rank: int | None = None, node_rank: int | None = None
    ) -> None:
        rank = self._ranks.get(rank_id)
        if rank is None:
            rank = self._ranks[rank_id] = RankWindow(rank_id, window=self.window)
        if global_rank is not None:
            rank.global_rank = global_rank
        if node_rank is not None:
            rank.node_rank = node_rank
        rank.add(cols)

    def snapshot(self) -> list[RankSnapshot]:
        """Medians of every rank's current window, ordered by global rank."""
        out = [
            RankSnapshot(
                rank_id=r.rank_id,
                global_rank=r.global_rank,
                node_rank=r.node_rank,
                steps_seen=r.steps_seen,
                last_step=r.last_step,
                last_ts=r.last_ts,
                step_ms_median=_median_ms(r.step_ns),
                phases_ms_median={p: _median_ms(v) for p, v in r.phases_ns.items()},
            )
            for r in self._ranks.values()
        ]
        out.sort(key=lambda s: (s.global_rank is None, s.global_rank or 0, s.rank_id))
        return out
