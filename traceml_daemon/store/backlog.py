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
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain
from operator import itemgetter

from traceml_daemon.ingest import TABLE_COLUMNS, RankState
from traceml_daemon.store.history import HISTORY_COLUMNS
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

    def add(self, steps_by_rank: dict[int, list[list[Column]]], states: dict[int, RankState]) -> None:
        """Queue one committed transaction's step batches (only read, never changed)."""
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
        taken = StepBacklog(self.chunks, self.states, self.rows)
        self.chunks, self.states, self.rows = {}, {}, 0
        return taken

    def columns(self) -> Iterator[tuple[int, list[Column]]]:
        """(rank_id, its steps as one set of history columns in ``HISTORY_COLUMNS`` order,
        read-only, in commit order), one rank at a time: a fold that consumes each rank's
        columns before the next are made never holds every rank's copy at once."""
        for rank_id, chunks in self.chunks.items():
            if len(chunks) == 1:  # common with many ranks: the columns as they are, no copy
                yield rank_id, list(_PICK(chunks[0]))
            else:
                yield rank_id, [list(_chain(map(get, chunks))) for get in _GETTERS]
