"""Committed step columns waiting to be folded into history (pure; no I/O).

The writer used to fold every committed transaction's steps into history at
once: per rank and transaction that is a bucket computation, a merge per
level, a node merge and a reservoir offer, so at a few dozen steps per rank
and transaction the fixed costs dominated. Instead each commit hands its
columns to a ``StepBacklog`` (a list append per rank) and the whole backlog is
folded once per history write, as one long run of steps per rank.

The batches are kept whole (the decoded columns, shared with the live
aggregates, never copied); the columns history reads are picked out by index
once per fold. The writer folds early once the backlog holds ``IngestPolicy.history_backlog_rows`` rows, so its memory is
bounded whatever the ingest rate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import itemgetter
from typing import Any

from traceml_daemon.ingest import TABLE_COLUMNS, RankState
from traceml_daemon.store.schema import HISTORY_METRICS
from traceml_wire.tables import Column

HISTORY_COLUMNS = ("step", "ts", *(f"{m}_ns" for m in HISTORY_METRICS))
# Where each history column sits in a step batch (``TABLE_COLUMNS["steps"]`` order).
_HISTORY_INDEX = tuple(TABLE_COLUMNS["steps"].index(name) for name in HISTORY_COLUMNS)
_PICK = itemgetter(*_HISTORY_INDEX)


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

    def by_rank(self) -> dict[int, dict[str, Sequence[Any]]]:
        """rank_id -> its steps as one set of history columns (read-only), in commit order."""
        out: dict[int, dict[str, Sequence[Any]]] = {}
        for rank_id, chunks in self.chunks.items():
            if len(chunks) == 1:  # common with many ranks: the columns as they are, no copy
                out[rank_id] = dict(zip(HISTORY_COLUMNS, _PICK(chunks[0]), strict=True))
                continue
            out[rank_id] = {
                name: list(chain.from_iterable(map(itemgetter(i), chunks)))
                for name, i in zip(HISTORY_COLUMNS, _HISTORY_INDEX, strict=True)
            }
        return out
