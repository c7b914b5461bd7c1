"""A rank's rolling window over its newest steps: the one definition of "median
step and phase time over the last N steps" that live views share.

The daemon's writer pushes each committed batch of step columns into one per
rank (``ingest.live.Aggregates``, which ``/metrics`` and diagnosis read); the
TUI pushes the rows it reads from the database into its own. Pure: no I/O.

Memory is a fixed-size ring per series, so O(N) per rank whatever the run's
length, and a value of None (not measured) never enters a ring: a median is
over the newest N measured values of that series.

Pushing is O(1) (the columns are kept as they are); they are folded into the
rings when a view is read, or once a rank holds a window's worth, so the
ingest path pays one fold per rank per read (or per N steps), not one per
committed transaction, and memory stays bounded when nobody reads. Medians are
cached and recomputed only after new steps arrived.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import itemgetter, sub
from typing import Any

from traceml_daemon.analysis.ring import Ring
from traceml_daemon.analysis.stats import max_or_none
from traceml_wire.tables import PHASES, Column, columns

DEFAULT_WINDOW = 200
# A rank's pushed columns are folded once it holds this many rows (or a view is
# read): few enough that unread pushes stay small in memory (4096 ranks x 64 rows),
# many enough that the per-fold cost is spread over several batches.
FOLD_ROWS = 64

STEP_COLUMNS = columns("steps")
# The step columns a fold reads, and where they sit in a batch.
_FOLDED = ("step", "ts", "step_ns", "wait_ns", "comm_ns", *(f"{p}_ns" for p in PHASES if p != "wait"),
           "fwd_comm_ns", "bwd_comm_ns")
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
    wait_measured: bool = False  # comm (DDP's all-reduce) or FSDP2's collectives seen: busy is not the step
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

    def add(self, cols: dict[str, Sequence[Any]]) -> None:
        """Fold named step columns in now: ``fold`` calls it with the pushed batches, and a
        reader that already holds its rows (the TUI) calls it directly."""
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
        fwd_comm, bwd_comm = cols.get("fwd_comm_ns"), cols.get("bwd_comm_ns")
        if step_ns and _measured(fwd_comm, step_ns) and _measured(bwd_comm, step_ns):
            # FSDP2: the ranks wait for one another inside forward and backward, in the
            # collectives the agent timed; wait_ns is the step's residual (own work).
            self.wait_measured = True
            self.busy_ns.extend([s - (f or 0) - (b or 0) if s is not None else None
                                 for s, f, b in zip(step_ns, fwd_comm, bwd_comm, strict=True)])  # type: ignore[arg-type]
        elif step_ns and wait and len(wait) == len(step_ns):
            try:
                busy = list(map(sub, step_ns, wait))  # the usual case, in C
            except TypeError:  # a None in either: no busy time (a GPU step timed on the host only has no wait)
                busy = [s - w if s is not None and w is not None else None for s, w in zip(step_ns, wait, strict=True)]
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
            step = _ms(self.step_ns.median())
            busy = _ms(self.busy_ns.median()) if self.wait_measured else step
            self._cached = (step, {p: _ms(v.median()) for p, v in self.phases_ns.items()}, busy)
            self.dirty = False
        return self._cached


_PHASE_COLUMNS = tuple((p, f"{p}_ns") for p in PHASES)


def _measured(values: Sequence[Any] | None, like: Sequence[Any]) -> bool:
    """A column as long as the steps with some value in it (one C pass: count)."""
    return bool(values) and len(values) == len(like) and values.count(None) != len(values)  # type: ignore[union-attr]


def _ms(ns: float | None) -> float | None:
    return None if ns is None else ns / 1e6
