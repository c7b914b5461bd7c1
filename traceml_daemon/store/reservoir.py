"""Per-rank uniform samples of raw step points (Algorithm L), for whole-run medians.

Each rank keeps up to ``RESERVOIR_SIZE`` sampled points (fewer per rank in big
jobs: ``IngestPolicy.reservoir_size_for``) plus slot ``LATEST_SLOT``, which always
holds the newest point. The sample's state lives here, its rows in SQL
(``reservoir``, ``reservoir_state``). It is uniform however the points are split
into offers, and a pure function of the split: each offer that draws takes a
stream seeded from the rank and the saved state (``seeded_stream``), so a
retried transaction or a restarted daemon draws the same sample.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import itemgetter
from typing import Any

from traceml_daemon.store.history_buckets import HISTORY_COLUMNS, Columns, history_columns
from traceml_daemon.store.schema import LATEST_SLOT, RESERVOIR_SIZE

# Reservoir.offer_columns builds a drawn point's row from the columns by position.
assert len(HISTORY_COLUMNS) == 9, "Reservoir.offer_columns unpacks exactly the history columns"

_LAST = itemgetter(-1)
# Bits drawn for the replaced slot: ``% k`` of them is uniform within k / 2**22.
_SLOT_BITS = 22


def seeded_stream(rank_id: int, next_take: int) -> random.Random:
    """The draws of one offer, seeded from the rank and its saved state.

    Algorithm L consumes it in order (``Reservoir._draws``), one draw per point
    that enters. A retried transaction (the state rolled back) and a restarted
    daemon (the state reloaded) seed the same stream and draw the same sample.
    Seeded per offer, not kept per rank: a kept stream would hold a few KB per
    rank for a seeding cost paid at most once per rank and history write.
    """
    return random.Random((rank_id << 64) | next_take)


@dataclass
class ReservoirState:
    """Algorithm L: after the first k points, skip ahead to the next point
    that enters the sample instead of drawing a random number per point."""

    seen: int = 0
    next_take: int = 0  # index (0-based, over all points seen) of the next point to enter
    w: float = 0.0
    size: int = RESERVOIR_SIZE  # points in this rank's sample, fixed when it starts


@dataclass
class ReservoirUpdate:
    rows: dict[tuple[int, int], tuple[Any, ...]] = field(default_factory=dict)  # (rank_id, slot) -> row
    states: dict[int, ReservoirState] = field(default_factory=dict)
    before: dict[int, ReservoirState] = field(default_factory=dict)  # for rollback


class Reservoir:
    """Per-rank uniform samples of raw step points; state lives here, rows in SQL."""

    def __init__(self, size: int = RESERVOIR_SIZE) -> None:
        self.size = size  # the sample size of a rank offered none
        self.states: dict[int, ReservoirState] = {}

    def load(self, rows: Iterable[tuple[int, int, int, float, int]]) -> None:
        for rank_id, seen, next_take, w, size in rows:
            self.states[rank_id] = ReservoirState(seen, next_take, w, size)

    @staticmethod
    def _draws(stream: random.Random) -> tuple[float, float, int]:
        """(u1, u2, h): two uniforms in (0, 1] and the slot's bits, taken from the
        stream in the order ``offer_columns`` (which inlines this) takes them: h first."""
        h = stream.getrandbits(_SLOT_BITS)
        return 1.0 - stream.random(), 1.0 - stream.random(), h

    @staticmethod
    def _gap(w: float, u: float) -> int:
        """How many points until the next one enters (>= 1)."""
        if w >= 1.0:
            return 1
        return int(math.log(u) / math.log1p(-w)) + 1

    def offer(self, rank_id: int, cols: dict[str, Sequence[Any]], update: ReservoirUpdate) -> None:
        self.offer_columns(rank_id, history_columns(cols), update)

    def offer_columns(self, rank_id: int, columns: Columns, update: ReservoirUpdate, size: int | None = None) -> None:
        """Offer one rank's new points (``HISTORY_COLUMNS`` order) to its sample.

        ``size``: the sample size of a rank offered its first points (default
        ``self.size``); a rank keeps the size it started with."""
        steps = columns[0]
        n = len(steps)
        if n == 0:
            return
        state = self.states.get(rank_id)
        if state is None:
            state = self.states[rank_id] = ReservoirState(size=size or self.size)
        k = state.size
        if rank_id not in update.before:
            update.before[rank_id] = ReservoirState(state.seen, state.next_take, state.w, k)
        rows = update.rows
        start = state.seen
        end = start + n
        fill = max(0, min(n, k - start))
        if fill:  # filling: every point enters, keys and rows built column-wise in C
            slots = range(start, start + fill)
            keys = zip(repeat(rank_id, fill), slots, strict=True)
            values = zip(repeat(rank_id, fill), slots, *(c[:fill] for c in columns), strict=True)
            rows.update(zip(keys, values, strict=True))
        if end > k and (state.w == 0.0 or state.next_take < end):  # a point of this offer enters
            stream = seeded_stream(rank_id, state.next_take)
            if state.w == 0.0:  # the sample just filled (or was backfilled by a migration)
                begin = max(start, k)
                u1, u2, _ = self._draws(stream)
                state.w = u1 ** (1.0 / k)
                state.next_take = begin - 1 + self._gap(state.w, u2)
            w, take = state.w, state.next_take
            # Algorithm L: only the points that enter are touched, ~k*ln(seen) of them in all.
            # ``_draws`` and ``_gap`` inlined (the same draws in the same order, so the same
            # sample): early in a run with many ranks this loop is hot. It only notes which
            # point each drawn slot takes: early in a run one offer replaces the same slot
            # several times, and a row is built once per slot below.
            uniform, bits, log, log1p = stream.random, stream.getrandbits, math.log, math.log1p
            inv_k = 1.0 / k
            picked: dict[int, int] = {}  # slot -> the position that took it last
            while take < end:
                picked[bits(_SLOT_BITS) % k] = take
                w *= (1.0 - uniform()) ** inv_k
                u2 = 1.0 - uniform()  # taken whatever w is: every draw takes three numbers
                take += 1 if w >= 1.0 else int(log(u2) / log1p(-w)) + 1
            # The rows from the columns held in locals, cheaper than an itemgetter, a map
            # and an unpacking a row.
            c0, c1, c2, c3, c4, c5, c6, c7, c8 = columns  # HISTORY_COLUMNS (their count is asserted at import)
            for slot, position in picked.items():
                i = position - start
                rows[(rank_id, slot)] = (rank_id, slot, c0[i], c1[i], c2[i], c3[i], c4[i], c5[i], c6[i], c7[i], c8[i])
            state.w, state.next_take = w, take
        state.seen = end
        rows[(rank_id, LATEST_SLOT)] = (rank_id, LATEST_SLOT, *map(_LAST, columns))
        update.states[rank_id] = state

    def rollback(self, update: ReservoirUpdate) -> None:
        self.states.update(update.before)


def reservoir_rows(update: ReservoirUpdate) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    rows = list(update.rows.values())
    states = [(rid, s.seen, s.next_take, s.w, s.size) for rid, s in update.states.items()]
    return rows, states
