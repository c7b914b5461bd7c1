"""Which run the TUI shows, and which runs started since it opened.

Many jobs may write to one daemon. The view shows either a session it was told
to (``tui --session``, or one chosen in the run picker), or the latest run as of
its first look; it follows that session's restarts (a new attempt) but never
jumps to another job: sessions that start later are listed in ``new_runs`` for
the app to announce. New rank rows are found by rank id (``runs.ranks_after``),
so a refresh reads only the senders stored since the previous one.

Stdlib sqlite3 only, no Textual: ``TuiData`` calls it from its worker, and the
app only hands it requests (``request``), which the next read applies.
"""

from __future__ import annotations

import sqlite3

from traceml_daemon.store.read.connect import has_table
from traceml_daemon.store.read.runs import RunRef, latest_run, ranks_after


class RunChoice:
    """The run on screen: pinned to a session, or following the latest run it found first."""

    def __init__(self, pinned: str | None = None) -> None:
        self.pinned = pinned  # None: follow the latest run (as of the first look)
        self.run: RunRef | None = None  # the run shown, once one is stored
        self._attempts: dict[str, int] = {}  # session -> highest attempt seen
        self._cursor = 0  # rank ids up to here were scanned
        self._scanned = False  # sessions there at the first look are not new
        self._new: list[str] = []  # sessions stored after the first look, in order
        self._request: tuple[str | None] | None = None  # a pick from the UI, not applied yet

    def request(self, session: str | None) -> None:
        """Show ``session`` from the next read on (None: the latest run, followed as at start).

        Called on the UI thread while a worker may be reading: one attribute store,
        which the worker picks up at its next ``choose``."""
        self._request = (session,)

    @property
    def new_runs(self) -> list[str]:
        """Sessions that started after the view opened and were never shown."""
        return list(self._new)

    def choose(self, conn: sqlite3.Connection) -> RunRef | None:
        """The run to read now; None while nothing (or not the pinned session) is stored."""
        if not has_table(conn, "ranks"):
            return None
        for rank_id, session, attempt in ranks_after(conn, self._cursor):
            self._cursor = rank_id
            if session not in self._attempts and self._scanned:
                self._new.append(session)
            self._attempts[session] = max(int(attempt), self._attempts.get(session, int(attempt)))
        self._scanned = True
        request, self._request = self._request, None
        if request is not None:
            self.pinned = request[0]
            if self.pinned is None:
                self.run = None  # follow the latest run again, as at start
        if self.pinned is not None:
            session = self.pinned
        elif self.run is not None:
            session = self.run.session
        else:
            latest = latest_run(conn)
            if latest is None:
                return None
            session = latest.session
        attempt = self._attempts.get(session)
        # A restart of the shown session (a higher attempt) is the same job: followed.
        self.run = None if attempt is None else RunRef(session, attempt)
        if self.run is not None and session in self._new:
            self._new.remove(session)  # a run once shown is not new any more
        return self.run
