"""History fed from committed steps: queued, folded and written when due.

After each COMMIT the writer queues the committed step columns in a
``StepBacklog`` (O(1) per rank). History is folded from that backlog and written
every ``history_interval`` seconds (longer with thousands of ranks:
``IngestPolicy.history_interval_for``), or once the backlog holds
``IngestPolicy.history_backlog_rows_for`` rows, and at close, at the head of a row
transaction. The fold runs on the database thread just before that transaction's
own rows, so a second's worth of folding never stalls the event loop in one piece.
Raw rows stay the acknowledged, durable data; history may lag by one interval.

Each history write also stores ``meta.history_steps_rowid``, the highest steps
rowid it covers, in the same transaction, so ``open()`` catches up on the rows a
crash left unfolded (``ingest/resume.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain

import aiosqlite

from traceml_daemon.ingest.backlog import StepBacklog
from traceml_daemon.ingest.decode import RankState
from traceml_daemon.ingest.quarantine import is_data_error
from traceml_daemon.ingest.transactions import run_transaction
from traceml_daemon.store import history
from traceml_daemon.store.db_thread import on_db_thread
from traceml_daemon.store.policy import IngestPolicy
from traceml_daemon.store.statements import Statement, multi_row_stream

log = logging.getLogger("traceml_daemon.writer")

_chain = chain.from_iterable

# What a history write runs first in its transaction: the statements that write it.
HistoryHead = Callable[[], Iterable[Statement]]

HISTORY_MARK = "history_steps_rowid"
# Evaluated inside the history-writing transaction before its own rows go in: every
# steps row at or below it was committed earlier, hence folded into what is written.
MARK_SQL = (
    "INSERT OR REPLACE INTO meta (key, value) VALUES (?, (SELECT coalesce(max(rowid), 0) FROM steps))",
    (HISTORY_MARK,),
)


@dataclass
class PendingHistory:
    """History folded from committed rows, not yet written."""

    ranks: dict[tuple[int, int, int], history.Stats] = field(default_factory=dict)
    nodes: dict[tuple[str, int, int, int, int], history.Stats] = field(default_factory=dict)
    reservoir: history.ReservoirUpdate = field(default_factory=history.ReservoirUpdate)

    @property
    def empty(self) -> bool:
        return not (self.ranks or self.nodes or self.reservoir.rows or self.reservoir.states)

    def absorb(self, later: PendingHistory) -> None:
        """Fold ``later`` (newer) into this one: sums merge, newer reservoir rows win."""
        for mine, theirs in ((self.ranks, later.ranks), (self.nodes, later.nodes)):
            if not mine:  # the usual case: one fold per write
                mine.update(theirs)
                continue
            for key, stats in theirs.items():
                have = mine.get(key)
                if have is None:
                    mine[key] = stats
                else:
                    history.merge_into(have, stats)
        self.reservoir.rows.update(later.reservoir.rows)
        self.reservoir.states.update(later.reservoir.states)

    def statements(self) -> Iterator[Statement]:
        """What writes it all, built statement by statement as the transaction runs
        (nothing may change this history until the iterator is spent)."""
        yield MARK_SQL
        for parts, deltas in ((history.RANK_UPSERT_PARTS, self.ranks), (history.NODE_UPSERT_PARTS, self.nodes)):
            # Each item is (key, stats): flattened once more, a row's values.
            yield from multi_row_stream(parts, map(_chain, deltas.items()), len(deltas))
        rows, states = self.reservoir.rows, self.reservoir.states
        yield from multi_row_stream(history.RESERVOIR_UPSERT_PARTS, rows.values(), len(rows))
        yield from multi_row_stream(
            history.RESERVOIR_STATE_UPSERT_PARTS,
            ((rid, s.seen, s.next_take, s.w, s.size) for rid, s in states.items()),
            len(states),
        )


class HistoryFeed:
    """The writer's history: committed steps waiting (``backlog``), history folded but
    not written (``pending``: a failed write keeps it for the next one), the reservoir's
    sampling state, and when the next write is due. ``known_ranks``: how many ranks the
    writer knows now (the pace of writes scales with it)."""

    def __init__(self, policy: IngestPolicy, known_ranks: Callable[[], int]) -> None:
        self.policy = policy
        self.known_ranks = known_ranks
        self.reservoir = history.Reservoir()
        self.backlog = StepBacklog()
        self.pending = PendingHistory()
        self._due = 0.0

    def fold(
        self,
        columns_by_rank: Iterable[tuple[int, history.Columns, list[tuple[int, history.Stats]] | None]],
        states: dict[int, RankState],
    ) -> None:
        """Add committed steps ((rank_id, columns in ``history.HISTORY_COLUMNS`` order, their
        fine buckets if their agents sent them, else None), one rank at a time) to the
        pending history (pure CPU, nothing written)."""
        pending = self.pending
        deltas: dict[tuple[int, int, int], history.Stats] = {}
        offer = self.reservoir.offer_columns
        size_for = self.policy.reservoir_size_for
        for rank_id, cols, fine in columns_by_rank:
            if fine is None:
                history.add_rank_deltas(rank_id, cols, deltas)
            else:
                history.add_fine_deltas(rank_id, fine, deltas)
            # The size a new sample gets from its job (offer_columns keeps a started one's).
            st = states.get(rank_id)
            offer(rank_id, cols, pending.reservoir, size_for(st.world_size if st is not None else None))

        def node_of(rank_id: int) -> history.NodeKey | None:
            st = states.get(rank_id)
            if st is None or st.node_rank is None:
                return None
            return (st.session or "unknown", st.attempt, st.node_rank)

        pending.absorb(PendingHistory(deltas, history.node_deltas(deltas, node_of)))

    def due_now(self, force: bool) -> bool:
        """Whether a write is due (``force``: whenever there is anything to write)."""
        if self.backlog.rows == 0 and self.pending.empty:
            return False
        if force or time.monotonic() >= self._due:
            return True
        return self.backlog.rows >= self.policy.history_backlog_rows_for(self.known_ranks())

    def _head(self, backlog: StepBacklog) -> Iterator[Statement]:
        """Fold ``backlog`` into the pending history and return what writes it all.

        Runs on the database thread, inside the transaction's call: the event loop
        does not touch the reservoir or the pending history while a write is out."""
        if backlog.rows:
            self.fold(backlog.columns(), backlog.states)
        return self.pending.statements()

    def take(self, force: bool) -> HistoryHead | None:
        """The history head for the next transaction if history is due (or ``force``)."""
        if not self.due_now(force):
            return None
        backlog = self.backlog.take()
        return lambda: self._head(backlog)

    def written(self, head: HistoryHead | None, ok: bool) -> None:
        """The transaction that carried ``head`` (if any) committed (``ok``) or not."""
        if head is None:
            return
        if ok:
            interval = self.policy.history_interval_for(self.known_ranks())
            self._due = time.monotonic() + interval
            self.pending = PendingHistory()
        # Not written: what was folded stays pending, ahead of anything folded later.

    async def flush(self, db: aiosqlite.Connection) -> bool:
        """Write whatever history there is now, in a transaction of its own. False when
        it could not be written for what it holds, and was let go."""
        head = self.take(force=True)
        if head is None:
            return True
        try:
            await on_db_thread(db, run_transaction, [], head)
        except Exception as exc:
            if not is_data_error(exc):
                # Raw rows are safe; the next open catches history up from them.
                log.error("history write failed: %s", exc)
                self.written(head, False)
                return True
            # Written alone it still fails: kept, it would fail every later write and
            # every open's catch-up. The raw rows stay; their history is let go.
            log.error("history write failed for what it holds (%s: %s): dropped, raw rows kept",
                      type(exc).__name__, exc)
            self.drop()
            try:
                await on_db_thread(db, run_transaction, [MARK_SQL])
            except Exception as mark_exc:
                log.error("history mark not written: %s", mark_exc)
            return False
        self.written(head, True)
        return True

    def drop(self) -> None:
        """Forget the history folded and not written; the samples go back to before it."""
        self.reservoir.rollback(self.pending.reservoir)
        self.pending = PendingHistory()
