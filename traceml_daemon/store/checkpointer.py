"""WAL checkpoints on a thread of their own, beside the writer.

In WAL mode every commit appends pages to the ``-wal`` file, and a checkpoint
copies them back into the database file. SQLite's automatic checkpoint runs
inside the COMMIT that crosses ``wal_autocheckpoint`` pages, on the committing
connection: in the daemon that is the writer's database thread, the ingest
pipeline's bottleneck (figures: docs/performance.md).

The ``Checkpointer`` thread looks at the WAL every ``interval_s`` and, once
``frames`` pages wait to be copied, runs a PASSIVE checkpoint from a second
connection: it copies what is committed without taking any lock the writer
waits for (a PASSIVE checkpoint never blocks, and gives up on what it cannot
copy), and sqlite3 releases the GIL while SQLite works, so the copying runs on
another core while the writer goes on. The thread copies as much as the
automatic checkpoint did (the same ``frames`` cadence: checkpointing every
tick would copy the pages every commit rewrites, index tails, many times over).

After a checkpoint, the frames committed while it ran are copied at the next
ticks, so that the WAL is soon fully copied between two of the writer's
transactions: the writer's next transaction then starts the WAL file over
from its beginning (SQLite's WAL restart). The writer's own automatic
checkpoint stays on, at twice ``frames``, as the backstop (the thread
stopped, or a reader that holds old frames), so the file stays under about
twice the size inline checkpoints keep it at (it is reused, not grown, after that).

Whether pages wait is read from the WAL-index header in the ``-shm`` file
(``mxFrame`` and ``nBackfill``, https://www.sqlite.org/walformat.html): a 132-byte
read with no lock and no SQLite call, through ``store/wal_index.py``, which never
closes a descriptor SQLite may hold locks through. A header that does not parse (another
format version, no file) means no checkpoint from here; the writer's backstop
then does the work, as before. Failed checkpoints are counted and logged once
per kind; they never reach the writer.
"""

from __future__ import annotations

import logging
import sqlite3
import struct
import threading

from traceml_daemon.store import wal_index

log = logging.getLogger(__name__)

# WAL-index header (native byte order): iVersion u32 at 0, isInit u8 at 12, mxFrame u32
# at 16; the checkpoint info follows the header's two 48-byte copies: nBackfill u32 at 96.
_WAL_INDEX_VERSION = 3007000
_HEADER_BYTES = 132
_VERSION = struct.Struct("=I")
_IS_INIT_AT = 12
_MX_FRAME_AT = 16
_BACKFILL_AT = 96


def wal_progress(header: bytes) -> tuple[int, int] | None:
    """(frames in the WAL, frames already copied into the database) from the first
    bytes of a ``-shm`` file; None when they are not a WAL-index this code reads."""
    if len(header) < _HEADER_BYTES or _VERSION.unpack_from(header, 0)[0] != _WAL_INDEX_VERSION:
        return None
    if header[_IS_INIT_AT] != 1:
        return None
    frames = _VERSION.unpack_from(header, _MX_FRAME_AT)[0]
    copied = _VERSION.unpack_from(header, _BACKFILL_AT)[0]
    return frames, min(copied, frames)


class Checkpointer:
    """A thread that checkpoints ``path``'s WAL once ``frames`` pages wait, looking
    every ``interval_s`` seconds, until stopped."""

    def __init__(self, path: str, interval_s: float, frames: int) -> None:
        self.path = path
        self.interval_s = interval_s
        self.frames = max(1, frames)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.runs = 0  # checkpoints run (whether or not they copied everything)
        self.frames_copied = 0  # WAL frames (pages) copied into the database file
        self.errors = 0
        self._last_error: str | None = None
        self._catching_up = False  # a checkpoint ran since the WAL last started over

    def start(self) -> None:
        if self._thread is not None or self.interval_s <= 0:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="traceml-checkpointer", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop after the checkpoint in progress (waiting at most ``timeout``)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join(timeout)
        if thread.is_alive():
            log.warning("WAL checkpointer still busy after %.0f s; left to finish on its own", timeout)

    def statistics(self) -> dict[str, int]:
        return {"checkpoints": self.runs, "checkpoint_frames": self.frames_copied, "checkpoint_errors": self.errors}

    def due(self, progress: tuple[int, int] | None) -> bool:
        """Whether to checkpoint now, given ``wal_progress``: ``frames`` pages wait, or
        a checkpoint ran and pages committed since wait (copy them, so the writer can
        start the WAL over)."""
        if progress is None:
            return False
        in_wal, copied = progress
        if copied == 0:  # started over (or never copied): wait for a full cadence
            self._catching_up = False
        return in_wal - copied >= self.frames or (self._catching_up and in_wal > copied)

    def checkpoint(self, conn: sqlite3.Connection) -> None:
        """One PASSIVE checkpoint on ``conn``, counted."""
        try:
            _busy, _in_wal, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.Error as exc:
            self.errors += 1
            message = f"{exc.__class__.__name__}: {exc}"
            if message != self._last_error:  # once per kind of failure, not once per tick
                log.warning("WAL checkpoint failed (the writer checkpoints on its own meanwhile): %s", message)
                self._last_error = message
            return
        self._last_error = None
        self.runs += 1
        self._catching_up = True
        self.frames_copied += max(0, copied)

    def read_progress(self) -> tuple[int, int] | None:
        """The WAL's progress from the head of the ``-shm`` file."""
        header = wal_index.read_head(self.path, _HEADER_BYTES)
        return None if header is None else wal_progress(header)

    def _run(self) -> None:
        try:
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            self.errors += 1
            log.warning("WAL checkpointer could not open %s: %s", self.path, exc)
            return
        try:
            while not self._stop.wait(self.interval_s):
                if self.due(self.read_progress()):
                    self.checkpoint(conn)
        finally:
            conn.close()
            wal_index.release_unnamed()
