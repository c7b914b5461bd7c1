"""Whether a failed write failed because the disk (or the database's page limit) is full.

SQLite reports it as ``SQLITE_FULL`` (an OperationalError, "database or disk is
full"), also when ``PRAGMA max_page_count`` is reached; the file system as
ENOSPC or, under a quota, EDQUOT. The writer treats it apart from other
failures of the machine (``ingest/disk_full.py``): a resend would only fail
the same way.
"""

from __future__ import annotations

import errno
import sqlite3

_FULL_ERRNOS = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})


def is_disk_full(exc: BaseException | None) -> bool:
    """True for SQLITE_FULL (any extended code) and for ENOSPC / EDQUOT."""
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)
        return isinstance(code, int) and code & 0xFF == sqlite3.SQLITE_FULL
    return isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS
