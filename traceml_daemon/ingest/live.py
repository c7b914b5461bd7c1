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
from dataclasses import dataclass, field
from itertools import chain
from operator import itemgetter, sub
from typing import Any

from traceml_daemon.analysis.nodes import by_node_with_worst, worst_key
from traceml_daemon.analysis.stats import max_or_none
from traceml_daemon.ingest.ring import Ring
from traceml_wire.tables import PHASES, Column, columns

DEFAULT_WINDOW = 200
# A rank's pushed columns are folded once it holds this many rows (or a view is
# read): few enough that unread pushes stay small in memory (4096 ranks x 64 rows),
# many enough that the per-fold cost is spread over several batches.
FOLD_ROWS = 64

STEP_COLUMNS = columns("steps")
# The step columns a fold reads, and where they sit in a batch.
_FOLDED = ("step", "ts", "step_ns", "wait_ns", "comm_ns", *(f"{p}_ns" for p in PHASES if p != "wait"))
_FOLDED_AT = tuple((name, STEP_COLUMNS.index(name)) for name in _FOLDED)
_PICK = itemgetter(*(i for _, i in _FOLDED_AT))
_STEP_AT, _TS_AT, _COMM_AT = (STEP_COLUMNS.index(name) for name in ("step", "ts", "comm_ns"))


@dataclass
class RankWindow:
    rank_id: int
    global_rank: int | None = None
    node_rank: int | None = None
    window: int = DEFAULT_WINDOW
    steps_seen: int = 0
    last_step: int | None = None
    last_ts: float | None = None
    step_ns: Ring = field(init=False)
    busy_ns: Ring = field(init=False)  # step minus wait, per step
    wait_measured: bool = False  # comm (DDP's all-reduce) seen: wait is time blocked on peers
    phases_ns: dict[str, Ring] = field(init=False)
    dirty: bool = field(init=False, default=True)
    # Step batches pushed but not folded into the windows yet (see the module docstring),
    # each its columns in ``STEP_COLUMNS`` order, read-only.
    pending: list[Sequence[Column]] = field(init=False, default_factory=list)
    pending_rows: int = field(init=False, default=0)
    _cached: tuple[float | None, dict[str, float | None], float | None] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        # Nanosecond columns are INT on the wire: int64 rings take them without conversion.
        self.step_ns = Ring(self.window, "q")
        self.busy_ns = Ring(self.window, "q")
        self.phases_ns = {p: Ring(self.window, "q") for p in PHASES}

    def push(self, cols: dict[str, list[Any]]) -> None:
        """Keep ``cols`` (read-only from now on) for the next fold."""
        n = len(cols.get("step") or ())
        if n:
            self.push_batches([[cols.get(name) or (None,) * n for name in STEP_COLUMNS]])

    def push_batches(self, batches: Sequence[Sequence[Column]]) -> None:
        """Keep step batches (columns in ``STEP_COLUMNS`` order, read-only) for the next fold."""
        self.pending += batches
        self.pending_rows += sum(len(cols[0]) for cols in batches)
        if self.pending_rows >= min(self.window, FOLD_ROWS):
            self.fold()

    def fold(self) -> None:
        """Bring the windows and counters up to date with every pushed batch."""
        if not self.pending:
            return
        chunks, rows, self.pending, self.pending_rows = self.pending, self.pending_rows, [], 0
        # The rings keep only the newest ``window`` values: a chunk entirely older than
        # that only advances the counters (a fast rank sends many windows' worth between
        # folds, and extending the rings with them was most of the fold's cost).
        skip = 0
        while skip < len(chunks) - 1 and rows - len(chunks[skip][0]) >= self.window:
            old = chunks[skip]
            rows -= len(old[0])
            self._count(old[_STEP_AT], old[_TS_AT], old[_COMM_AT])
            skip += 1
        if skip:
            chunks = chunks[skip:]
        # One pass over the concatenated columns, and only those read, costs far less
        # than one per chunk. (The columns are shared with the history backlog: build
        # new lists, never change them.)
        if len(chunks) == 1:
            self.add(dict(zip(_FOLDED, _PICK(chunks[0]), strict=True)))
        else:
            self.add({name: list(chain.from_iterable(map(itemgetter(i), chunks))) for name, i in _FOLDED_AT})

    def _count(self, steps: Sequence[Any], ts: Sequence[Any] | None, comm: Sequence[Any] | None) -> None:
        """Advance steps seen, the last step and its time, and whether wait is measured."""
        n = len(steps)
        if n == 0:
            return
        self.steps_seen += n
        self.dirty = True
        # Decoded columns hold ints (or None): max() raises on a None among them (and
        # returns it when alone), so the Nones are filtered only when there are some.
        top = max_or_none(steps)
        if top is not None and (self.last_step is None or top >= self.last_step):
            self.last_step = top
            if ts:
                stamp = max_or_none(ts)
                if stamp is not None:
                    self.last_ts = stamp
        if comm and not self.wait_measured:
            self.wait_measured = any(v is not None for v in comm)

    def add(self, cols: dict[str, list[Any]]) -> None:
        steps = cols.get("step") or []
        if not steps:
            return
        # Whole-column C-level passes (max, Ring.extend) instead of a Python loop
        # per row: this runs for every committed step row, on the event loop.
        self._count(steps, cols.get("ts"), cols.get("comm_ns"))
        step_ns = cols.get("step_ns")
        if step_ns:
            self.step_ns.extend(step_ns)  # skips None (not measured): out of the median
        wait = cols.get("wait_ns")
        if step_ns and wait and len(wait) == len(step_ns):
            try:
                busy = list(map(sub, step_ns, wait))  # the usual case, in C
            except TypeError:  # a None in either
                busy = [s - (w or 0) if s is not None else None for s, w in zip(step_ns, wait, strict=True)]
            self.busy_ns.extend(busy)
        elif step_ns:
            self.busy_ns.extend(step_ns)
        phases = self.phases_ns
        for phase, name in _PHASE_COLUMNS:
            values = cols.get(name)
            if values:
                phases[phase].extend(values)

    def medians(self) -> tuple[float | None, dict[str, float | None], float | None]:
        """(step, phases, busy) medians in ms; busy is the step's where wait is not measured."""
        self.fold()
        if self.dirty or self._cached is None:
            step = _median_ms(self.step_ns)
            busy = _median_ms(self.busy_ns) if self.wait_measured else step
            self._cached = (step, {p: _median_ms(v) for p, v in self.phases_ns.items()}, busy)
            self.dirty = False
        return self._cached


_PHASE_COLUMNS = tuple((p, f"{p}_ns") for p in PHASES)


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


def _median_ms(values: Ring) -> float | None:
    return statistics.median(values.values()) / 1e6 if values else None


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
