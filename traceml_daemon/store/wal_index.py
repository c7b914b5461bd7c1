"""Read the head of a database's ``-shm`` file (its WAL-index) without touching SQLite's locks.

POSIX record locks belong to a process and a file, not to a descriptor: closing
*any* descriptor of a file drops every lock the process holds on it. SQLite holds
a shared lock on the ``-shm`` file's "dead man switch" byte for as long as a
connection of the process has the WAL open; once that lock is gone, the next
connection another process opens finds itself the WAL's only user, truncates the
``-shm`` file and rebuilds it under this process's mapping (SIGBUS, and commits
written into a WAL that is no longer the one readers see).

So a ``-shm`` file is opened once and its descriptor kept while the file can still
be in SQLite's use: it is closed only once the path no longer names that file
(SQLite removes the ``-shm`` file when the last connection closes, so a file no
name reaches is one no connection will lock again). The descriptors are shared by
the whole process, one per live ``-shm`` file.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

SHM_SUFFIX = "-shm"


@dataclass(frozen=True)
class _OpenFile:
    dev: int
    ino: int
    fd: int

    def names(self, st: os.stat_result) -> bool:
        return (st.st_dev, st.st_ino) == (self.dev, self.ino)


_lock = threading.Lock()
_open: dict[str, _OpenFile] = {}  # -shm path -> the descriptor this process keeps on it


def _still_named(path: str, held: _OpenFile) -> bool:
    try:
        return held.names(os.stat(path))
    except OSError:
        return False


def _close_unnamed() -> None:
    """Close the descriptors of files their path no longer names (caller holds ``_lock``)."""
    for path, held in list(_open.items()):
        if not _still_named(path, held):
            del _open[path]
            os.close(held.fd)


def read_head(db_path: str, size: int) -> bytes | None:
    """The first ``size`` bytes of ``db_path``'s ``-shm`` file; None when there is none."""
    path = db_path + SHM_SUFFIX
    try:
        st = os.stat(path)  # a stat opens nothing, so it cannot drop a lock
    except OSError:
        return None
    with _lock:
        held = _open.get(path)
        if held is None or not held.names(st):
            _close_unnamed()
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                return None
            opened = os.fstat(fd)
            held = _open[path] = _OpenFile(opened.st_dev, opened.st_ino, fd)
        try:
            return os.pread(held.fd, size, 0)
        except OSError:
            return None


def release_unnamed() -> None:
    """Give back the descriptors of ``-shm`` files no name reaches any more (the others are
    kept: a connection may still hold locks on them, here or in another process)."""
    with _lock:
        _close_unnamed()


def descriptors_held() -> int:
    """How many ``-shm`` descriptors this process keeps (for tests and memory debugging)."""
    with _lock:
        return len(_open)
