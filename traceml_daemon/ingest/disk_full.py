"""The writer on a full disk: make room, store what fits, acknowledge and count the rest.

Why not leave it unacknowledged for the relays to resend, as after other
failures of the machine: acknowledgements are cumulative, so a daemon that
keeps a relay's connection and acknowledges its later batches has given the
earlier ones up anyway; and a resend into a full disk fails the same way, the
relay resending its whole buffer at every reconnect while the daemon decodes
it again. So a transaction that fails with the disk full (``store.disk_full``)
is settled here:

1. where a size cap allows deleting, the oldest raw rows go at once
   (``store.retention.make_room``) and the work is written again, whole;
2. what still does not fit is acknowledged unstored and counted
   (``batches_dropped_disk_full``, ``rows_dropped_disk_full``: delivery
   counters, stored by the next transaction that fits, shown live on
   ``/metrics``; the summary counts those rows as lost);
3. the log says so once when the disk fills, and once when writes fit again.

Writers that must not drop (``traceml-daemon ingest`` replaying a spool: it has
no relay to acknowledge and must report what it did not store) leave the work
unacknowledged instead, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from traceml_daemon.ingest.counters import Counters
from traceml_daemon.ingest.recovery import Outcome, WriteAlone
from traceml_daemon.ingest.staging import WorkItem
from traceml_daemon.store.disk_full import is_disk_full

log = logging.getLogger("traceml_daemon.writer")

Acks = tuple[list[bool], bool]  # per work item: acknowledge it; and whether all of it was stored


class DiskFull:
    """The writer's state on a full disk: whether it is full now, and what it does about it."""

    def __init__(self, counters: Counters, drop: bool) -> None:
        self.counters = counters
        self.drop = drop  # acknowledge and count what does not fit (serve), or leave it unacknowledged
        self.full = False
        self._dropped_at_start = (0, 0)  # batches and rows dropped before this episode

    def _entered(self, failure: BaseException) -> None:
        if self.full:
            return
        self.full = True
        c = self.counters
        self._dropped_at_start = (c.batches_dropped_disk_full, c.rows_dropped_disk_full)
        then = (
            "batches that do not fit are acknowledged unstored and counted (batches_dropped_disk_full)"
            if self.drop else "batches that do not fit stay unacknowledged"
        )
        log.warning("disk full (%s): retention makes room where a size cap allows; %s; said once", failure, then)

    def wrote(self) -> None:
        """A transaction committed: the disk holds writes again."""
        if not self.full:
            return
        self.full = False
        c = self.counters
        batches = c.batches_dropped_disk_full - self._dropped_at_start[0]
        rows = c.rows_dropped_disk_full - self._dropped_at_start[1]
        log.warning("writes fit again after the disk was full: %d batches (%d rows) were dropped meanwhile",
                    batches, rows)

    async def settle(
        self,
        work: list[WorkItem],
        rows: int,
        failure: BaseException,
        write: WriteAlone,
        make_room: Callable[[], Awaitable[int]],
    ) -> Acks | None:
        """``work`` failed with the disk full (``rows``: the rows it held after dedup).
        None: written again, it failed for its data after all (the caller writes it apart)."""
        self._entered(failure)
        acks = [False] * len(work)
        # Batches of a connection that failed meanwhile are resent by their relay: not written.
        todo = [i for i, item in enumerate(work) if item.live is None or item.live()]
        if not todo:
            return acks, False
        if await make_room():
            outcome, exc = await write([work[i] for i in todo], [])
            if outcome is Outcome.STORED:
                for i in todo:
                    acks[i] = True
                return acks, len(todo) == len(work)
            if outcome is Outcome.DATA:
                return None
            if not is_disk_full(exc):
                log.error("write of %d batches failed, not acknowledged: %s", len(todo), exc)
                return acks, False
        if not self.drop:
            return acks, False
        self.counters.batches_dropped_disk_full += sum(len(work[i].items) for i in todo)
        self.counters.rows_dropped_disk_full += rows
        for i in todo:
            acks[i] = True
        return acks, False
