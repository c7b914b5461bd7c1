"""Every threshold of the ingest path, in one place.

The writer, its history backlog and the aggregates read their limits from an
``IngestPolicy``; tests and benchmarks build one with ``dataclasses.replace``.
"""

from __future__ import annotations

from dataclasses import dataclass

from traceml_daemon.store.schema import RESERVOIR_SIZE


@dataclass(frozen=True)
class IngestPolicy:
    # Queued bytes per transaction at most: a full one is held twice, decoded, so this
    # bounds a saturated daemon's RSS for a little throughput (docs/performance.md).
    max_txn_bytes: int = 8 * 1024 * 1024
    # How long the writer waits for work before writing counters alone.
    flush_interval: float = 0.25
    # An idle writer finding under a quarter of max_txn_bytes queued waits this long for
    # more: fewer, larger COMMITs cost less CPU for some latency (docs/performance.md).
    coalesce_s: float = 0.1
    # History (buckets, node buckets, reservoir) is folded and written at most this
    # often: raw rows are the acknowledged data, history may lag by this much.
    history_interval: float = 1.0
    # ... and less often with many ranks (a write costs per rank): one second per this
    # many ranks, at least history_interval, at most history_interval_max.
    history_ranks_per_second: int = 1024
    history_interval_max: float = 4.0
    # ... or sooner once this many committed step rows wait to be folded, which
    # bounds the backlog's memory (9 columns per row) at any ingest rate ...
    history_backlog_rows: int = 65_536
    # ... and at least this many per known rank, so the interval, not the row bound, paces
    # writes with many ranks (the backlog shares the live aggregates' batches).
    history_backlog_rows_per_rank: int = 64
    # After each history write, hand the heap's free pages back (glibc malloc_trim): else
    # RSS keeps what the largest write's short-lived allocations needed.
    trim_heap_after_history: bool = True
    # The writer thread must get the GIL back quickly after each sqlite3_step.
    gil_switch_interval: float = 0.001
    # Cyclic garbage collection on this timer, not on allocation counts (ingest/hygiene.py):
    # walking ingest's short-lived containers cost much CPU (docs/performance.md).
    gc_interval_s: float = 30.0
    # Cleaned rbatch peer identities cached per connection (a relay repeats each of its
    # agents' identities in every rbatch); past this many senders the cache starts over.
    identity_cache_entries: int = 65_536
    # The writer's SQLite page cache, KiB: every commit appends to each sending rank
    # group's index tails, which must stay cached (in RSS only as pages are touched).
    sqlite_cache_kib: int = 48 * 1024
    # WAL pages before a checkpoint (the WAL grows to about this): a larger WAL copies
    # each hot index page once per checkpoint however often it was rewritten.
    wal_autocheckpoint_pages: int = 16_384
    # A thread of the writer's copies the WAL back at that cadence instead
    # (store/checkpointer.py), off the writer's database thread, looking this often;
    # the writer's own automatic checkpoint then waits for twice as many pages, as a
    # backstop. 0: no thread; the writer checkpoints inside its COMMIT, as SQLite does.
    checkpoint_interval_s: float = 0.1

    # Reservoir points (store/reservoir.py) over all of a job's ranks, each rank between
    # reservoir_min_size and schema.RESERVOIR_SIZE: the table must stay within the page
    # cache, as early replacements dirty random pages (docs/performance.md).
    reservoir_points_total: int = 262_144
    reservoir_min_size: int = 64

    def reservoir_size_for(self, world_size: int | None) -> int:
        """Points in the sample of a rank of a job of ``world_size`` ranks (None or 0: unknown)."""
        if world_size is None or world_size <= 0:
            return RESERVOIR_SIZE
        share = self.reservoir_points_total // world_size
        floor = min(self.reservoir_min_size, RESERVOIR_SIZE)
        return max(floor, min(RESERVOIR_SIZE, share))

    @property
    def writer_autocheckpoint_pages(self) -> int:
        """The writer connection's automatic checkpoint: the backstop behind the
        checkpointer thread when there is one."""
        backstop = 2 if self.checkpoint_interval_s > 0 else 1
        return backstop * self.wal_autocheckpoint_pages

    def writer_pragmas(self) -> list[str]:
        """Connection settings of the writer on top of ``schema.PRAGMAS``."""
        return [
            f"PRAGMA cache_size=-{self.sqlite_cache_kib}",
            f"PRAGMA wal_autocheckpoint={self.writer_autocheckpoint_pages}",
        ]

    def history_backlog_rows_for(self, ranks: int) -> int:
        """Committed step rows that make a history write due, with ``ranks`` ranks known."""
        return max(self.history_backlog_rows, self.history_backlog_rows_per_rank * ranks)

    def history_interval_for(self, ranks: int) -> float:
        """Seconds between history writes with ``ranks`` ranks known."""
        stretched = min(self.history_interval_max, ranks / self.history_ranks_per_second)
        return max(self.history_interval, stretched)


DEFAULT_POLICY = IngestPolicy()
