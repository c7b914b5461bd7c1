"""The daemon's files are private to its user unless asked otherwise.

The database holds every rank's hostnames, command output and timings; on a
shared head node a group- or world-readable file leaks them. The umask covers
everything the process creates later (WAL, shared-memory index, logs, summary
files); files left by an earlier run are narrowed too.
"""

from __future__ import annotations

import os

PRIVATE_UMASK = 0o077
SHARED_UMASK = 0o022
DB_SUFFIXES = ("", "-wal", "-shm")


def restrict_files(db_path: str, shared: bool = False) -> None:
    """Set the process umask and narrow the database's existing files to 0600 (or 0644 if shared)."""
    os.umask(SHARED_UMASK if shared else PRIVATE_UMASK)
    mode = 0o644 if shared else 0o600
    for suffix in DB_SUFFIXES:
        path = db_path + suffix
        try:
            if os.stat(path).st_uid == os.getuid():
                os.chmod(path, mode)
        except OSError:
            continue  # absent, or not ours to change: SQLite reports what matters on open
