"""Committed step columns waiting to be folded into history (pure; no I/O).

The writer used to fold every committed transaction's steps into history at
once: per rank and transaction that is a bucket computation, a merge per
level, a node merge and a reservoir offer, so at a few dozen steps per rank
and transaction the fixed costs dominated. Instead each commit hands its
columns to a ``StepBacklog`` (a list append per rank) and the whole backlog is
folded once per history write, as one long run of steps per rank.

Only the columns history reads are kept, and the writer folds early once the
backlog holds ``IngestPolicy.history_backlog_rows`` rows, so its memory is
bounded whatever the ingest rate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import Any

from traceml_daemon.ingest import RankState
from traceml_daemon.store.schema import HISTORY_METRICS

HISTORY_COLUMNS = ("step", "ts", *(f"{m}_ns" for m in HISTORY_METRICS))


@dataclass
class StepBacklog:
    chunks: dict[int, list[dict[str, list[Any]]]] = field(default_factory=dict)  # rank_id -> columns, commit order
    states: dict[int, RankState] = field(default_factory=dict)  # rank_id -> its latest identity
    rows: int = 0

    def add(self, steps_by_rank: dict[int, list[dict[str, list[Any]]]], states: dict[int, RankState]) -> None:
        """Queue one committed transaction's step batches (the lists are only read, never changed)."""
        for rank_id, batches in steps_by_rank.items():
            have = self.chunks.get(rank_id)
            if have is None:
                have = self.chunks[rank_id] = []
            for cols in batches:
                kept = {name: cols[name] for name in HISTORY_COLUMNS}
                have.append(kept)
                self.rows += len(kept["step"])
            state = states.get(rank_id)
            if state is not None:
                self.states[rank_id] = state

    def take(self) -> StepBacklog:
        """Everything queued so far; this backlog starts empty."""
        taken = StepBacklog(self.chunks, self.states, self.rows)
        self.chunks, self.states, self.rows = {}, {}, 0
        return taken

    def by_rank(self) -> dict[int, dict[str, list[Any]]]:
        """rank_id -> its steps as one set of columns, in commit order."""
        out: dict[int, dict[str, list[Any]]] = {}
        for rank_id, chunks in self.chunks.items():
            if len(chunks) == 1:
                out[rank_id] = chunks[0]
            else:
                out[rank_id] = {name: list(chain.from_iterable(c[name] for c in chunks)) for name in HISTORY_COLUMNS}
        return out
