"""Every threshold of the ingest path, in one place.

The writer, its history backlog and the aggregates read their limits from an
``IngestPolicy``; tests and benchmarks build one with ``dataclasses.replace``.
"""

from __future__ import annotations

from dataclasses import dataclass

from traceml_daemon.store.schema import RESERVOIR_SIZE


@dataclass(frozen=True)
class IngestPolicy:
    # One transaction takes at most this many queued bytes (the queue's own bound,
    # ServerConfig.queue_bytes, is what pushes back on relays). Only a saturated
    # daemon fills a transaction (paced 4096 ranks commit ~1 MB each), and a full
    # one is held twice, decoded (several times its wire size) while the one before
    # it is written: at 32 MiB a saturated daemon peaked at 889 MB RSS, at 8 MiB at
    # 409 MB, for 8% less throughput (121.5k vs 132.2k rows/s, same run,
    # bench/ingest.py --ranks 64 --modes throughput, relays not capped by acks).
    max_txn_bytes: int = 8 * 1024 * 1024
    # How long the writer waits for work before writing counters alone.
    flush_interval: float = 0.25
    # An idle writer that finds little queued (under a quarter of max_txn_bytes)
    # waits this long for more before it writes (StoreWriter.run). Relays flush at
    # their own times, and each transaction's COMMIT rewrites the index tail pages
    # of nearly every rank group whatever its size (a relay's ranks span many
    # groups), so fewer, larger transactions cost less: paced 4096 ranks behind 64
    # relays, same-run pairs in both orders (bench/ingest.py --versus): 0.1 s
    # 49% and 51% of a core against 53% and 56% without it, p50 latency 451 and
    # 401 ms against 301 and 302 ms, p99 1.41 and 1.40 s against 1.25 and 1.61 s
    # (0.25 s: 48% and 53% against 56% and 62%, p50 ~560-610 ms). A busy writer
    # never waits (the next batch piles up while the last one is written):
    # R=64 throughput 102k against 104k rows/s at 10 steps a flush, 276k against
    # 278k at 3333. (This was 0 because a coalescing wait was once measured to cut
    # R=64 throughput 3x, relays waiting for acks; with the idle-writer condition
    # the throughput cases above are unchanged.)
    coalesce_s: float = 0.1
    # History (buckets, node buckets, reservoir) is folded and written at most this
    # often: raw rows are the acknowledged data, history may lag by this much.
    history_interval: float = 1.0
    # ... and less often with many ranks: a write costs per rank (three bucket rows
    # and a reservoir point to upsert, a fold set up per rank), so at 4096 ranks one
    # write a second was ~4% of a core of the daemon's ~57% (measured, bench/ingest.py
    # 4096 ranks behind 64 relays). One second per this many ranks, at least
    # history_interval, at most history_interval_max.
    history_ranks_per_second: int = 1024
    history_interval_max: float = 4.0
    # ... or sooner once this many committed step rows wait to be folded, which
    # bounds the backlog's memory (9 columns per row) at any ingest rate ...
    history_backlog_rows: int = 65_536
    # ... and at least this many per known rank, so that the interval above, not the
    # row bound, sets the pace of history writes with many ranks: 4096 ranks at 10
    # steps/s fill 65,536 rows in 1.6 s, and history was written every 1.6 s instead
    # of every 4 s, each write rewriting every rank's current buckets and most of the
    # reservoir's pages (early in a run each rank replaces dozens of sampled points a
    # minute). The backlog holds the decoded batches the live aggregates hold anyway
    # (each rank's until it has 64 rows, aggregates.FOLD_ROWS), so this adds little memory.
    history_backlog_rows_per_rank: int = 64
    # After each history write, hand the heap's free pages back to the system
    # (glibc malloc_trim). A history write's fold and parameters are tens of MB of
    # short-lived allocations; freed, they stay in malloc's arenas as fragments and
    # the daemon's RSS kept what the largest write needed.
    trim_heap_after_history: bool = True
    # The writer thread must get the GIL back quickly after each sqlite3_step.
    gil_switch_interval: float = 0.001
    # The cyclic garbage collector runs on this timer, not on allocation counts.
    # Ingest allocates ~200k containers a second at 4096 ranks (decoded column
    # tuples, per-batch dicts), nearly all freed by reference counting, and the
    # collector walking them was ~9% of a core even with a young threshold of 20,000
    # (measured: 5.2 s of collection in a 60 s paced 4096-rank run, bench/ingest.py).
    # Automatic collection is therefore off in the daemon, and one full collection
    # every this many seconds frees the few cycles it makes (exceptions holding
    # their frames, closed connections); each takes tens of milliseconds.
    gc_interval_s: float = 30.0
    # Cleaned rbatch peer identities cached per connection (a relay repeats each of its
    # agents' identities in every rbatch); past this many senders the cache starts over.
    identity_cache_entries: int = 65_536
    # SQLite page cache of the writer's connection, KiB (SQLite's default is 2 MiB).
    # Every commit appends to each sending rank group's tail of the per-group indexes
    # (steps_by_group, process_by_group, ...; schema v4): at 4096 ranks that is 512
    # tails per index, a few MiB, and a 2 MiB cache re-reads most of them from the WAL
    # on every commit. (Keyed per rank, before v4, the tails were ~2 pages per rank
    # and index, more than this cache held, and the daemon's CPU climbed as they
    # spread.) Counted in the daemon's RSS only as pages are touched.
    sqlite_cache_kib: int = 48 * 1024
    # Pages in the WAL before SQLite checkpoints it back into the database (SQLite's
    # default is 1000, 4 MiB). At tens of MB/s of commits the default checkpoints
    # several times a second and copies the same hot index pages every time; a
    # larger WAL copies each page once per checkpoint however often it was rewritten.
    # The WAL file grows to about this many pages (x 4 KiB) before it is reused.
    wal_autocheckpoint_pages: int = 16_384
    # A thread of the writer's copies the WAL back at that cadence instead
    # (store/checkpointer.py), off the writer's database thread, looking this often;
    # the writer's own automatic checkpoint then waits for twice as many pages, as a
    # backstop. 0: no thread; the writer checkpoints inside its COMMIT, as SQLite does.
    checkpoint_interval_s: float = 0.1

    # The reservoir (store/history.py: a uniform sample of each rank's steps for
    # whole-run medians) holds at most this many points over all the ranks of a job,
    # and each rank between reservoir_min_size and schema.RESERVOIR_SIZE (256): up to
    # 1024 ranks keep 256 points each, 4096 ranks 64. A sample's writes are front-loaded
    # (k * (1 + ln(N / k)) rows per rank after N steps, each replacement a random row),
    # and at 4096 ranks x 256 the table (~60 MB) outgrew the page cache: in the first
    # minutes of a paced 4096-rank run the replacements dirtied nearly every page of it
    # at each history write, 15 points of a core and the p99 latency (bench/ingest.py,
    # paced 4096 with the sample off: 50% of a core against 65%, p99 0.8 s against 2.5 s).
    # 64 points still put a rank's median within ~1.6% at a 10% spread of step times.
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
