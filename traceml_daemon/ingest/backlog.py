"""Committed step columns waiting to be folded into history (pure; no I/O).

The writer used to fold every committed transaction's steps into history at
once: per rank and transaction that is a bucket computation, a merge per
level, a node merge and a reservoir offer, so at a few dozen steps per rank
and transaction the fixed costs dominated. Instead each commit hands its
columns to a ``StepBacklog`` (a list append per rank) and the whole backlog is
folded once per history write, as one long run of steps per rank.

The batches are kept whole (the decoded columns, shared with the live
aggregates, never copied); the columns history reads are picked out by index
once per fold. The writer folds early once the backlog holds
``IngestPolicy.history_backlog_rows_for`` rows (a floor, or 64 per known rank),
so its memory is bounded whatever the ingest rate.

Batches that came with history partials (``traceml_wire/partials.py``) are
kept with them: ``columns`` hands a rank's fine buckets over ready made (the
partials, merged with the stats of any batches that came without), so the
fold computes stats only for rows no agent summed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain
from operator import itemgetter

from traceml_daemon.ingest.decode import TABLE_COLUMNS, RankState
from traceml_daemon.store.history import HISTORY_COLUMNS, Stats, merge_fine
from traceml_wire.partials import fine_stats
from traceml_wire.tables import Column

# Where each history column sits in a step batch (``TABLE_COLUMNS["steps"]`` order).
_HISTORY_INDEX = tuple(TABLE_COLUMNS["steps"].index(name) for name in HISTORY_COLUMNS)
_PICK = itemgetter(*_HISTORY_INDEX)
_GETTERS = tuple(map(itemgetter, _HISTORY_INDEX))
_chain = chain.from_iterable


@dataclass
class StepBacklog:
    # rank_id -> its step batches in commit order, each the decoded columns as they
    # are (schema order, read-only): queuing one is a list extend per rank and
    # transaction, with no per-batch dict or copy.
    chunks: dict[int, list[list[Column]]] = field(default_factory=dict)
    states: dict[int, RankState] = field(default_factory=dict)  # rank_id -> its latest identity
    rows: int = 0
    # rank_id -> (a batch among its chunks, that batch's fine buckets as its agent sent them)
    partials: dict[int, list[tuple[list[Column], list[tuple[int, Stats]]]]] = field(default_factory=dict)

    def add(
        self,
        steps_by_rank: dict[int, list[list[Column]]],
        states: dict[int, RankState],
        partials_by_rank: dict[int, list[tuple[list[Column], list[tuple[int, Stats]]]]] | None = None,
    ) -> None:
        """Queue one committed transaction's step batches (only read, never changed),
        with the history partials some of them carried."""
        for rank_id, parts in (partials_by_rank or {}).items():
            have_parts = self.partials.get(rank_id)
            if have_parts is None:
                self.partials[rank_id] = list(parts)
            else:
                have_parts += parts
        chunks = self.chunks
        for rank_id, batches in steps_by_rank.items():
            have = chunks.get(rank_id)
            if have is None:
                chunks[rank_id] = list(batches)
            else:
                have += batches
            self.rows += sum(len(cols[0]) for cols in batches)
            state = states.get(rank_id)
            if state is not None:
                self.states[rank_id] = state

    def take(self) -> StepBacklog:
        """Everything queued so far; this backlog starts empty."""
        taken = StepBacklog(self.chunks, self.states, self.rows, self.partials)
        self.chunks, self.states, self.rows, self.partials = {}, {}, 0, {}
        return taken

    def columns(self) -> Iterator[tuple[int, list[Column], list[tuple[int, Stats]] | None]]:
        """(rank_id, its steps as one set of history columns in ``HISTORY_COLUMNS`` order,
        read-only, in commit order, and its fine buckets where partials came: None means
        fold the columns), one rank at a time: a fold that consumes each rank's columns
        before the next are made never holds every rank's copy at once."""
        partials = self.partials
        for rank_id, chunks in self.chunks.items():
            cols = _history_columns(chunks)
            parts = partials.get(rank_id)
            if parts is None:
                yield rank_id, cols, None
                continue
            covered = {id(batch) for batch, _ in parts}
            sets = [fine for _, fine in parts]
            bare = [batch for batch in chunks if id(batch) not in covered]
            if bare:
                sets.append(fine_stats(_history_columns(bare)))
            yield rank_id, cols, merge_fine(sets)


def _history_columns(chunks: list[list[Column]]) -> list[Column]:
    if len(chunks) == 1:  # common with many ranks: the columns as they are, no copy
        return list(_PICK(chunks[0]))
    return [list(_chain(map(get, chunks))) for get in _GETTERS]
