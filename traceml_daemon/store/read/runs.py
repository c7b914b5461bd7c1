"""Which run: sessions and attempts in the ``ranks`` table, a run's parallelism and time bounds.

A run is a session (one job: every rank of it shares the id) at its highest
attempt (torchelastic restarts). Readers default to ``latest_run`` and take a
session by name through ``resolve_run``; ``run_infos`` lists every run for
``traceml-daemon runs`` and the TUI's run picker. Only the ``ranks`` table is
scanned; telemetry tables are read through their per-rank indexes.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from traceml_daemon.store.read.connect import connect_file, has_table
from traceml_daemon.store.schema import rank_is

# A run that is not finished and was heard from within this many seconds is live;
# one silent longer stopped without saying so (a crash, a kill, a dead link).
LIVE_SILENCE_S = 30.0
# An unknown-session error names at most this many sessions, the newest.
_NAMED_SESSIONS = 20


@dataclass(frozen=True)
class RunRef:
    session: str
    attempt: int


class UnknownSession(LookupError):
    """``--session`` named a session the database does not hold; the message names those it does."""

    def __init__(self, session: str, known: list[str]) -> None:
        super().__init__(unknown_session_message(session, known))
        self.session = session
        self.known = known


def unknown_session_message(session: str, known: list[str]) -> str:
    """The one wording of an unknown session, shared by every reader (``known``: newest last)."""
    shown = known[-_NAMED_SESSIONS:]
    more = f" and {len(known) - len(shown)} older: `traceml-daemon runs` lists all" if len(known) > len(shown) else ""
    return f"no session {session!r} in the database (sessions: {', '.join(shown) or 'none'}{more})"


# Sessions newest first: by their newest rank's first appearance, so two jobs running
# at once do not trade places whenever one of them reports (as ordering by last_seen
# did); a restart or a reused session id brings a new rank row and so moves it first.
_SESSIONS_NEWEST_FIRST = (
    "SELECT session FROM ranks GROUP BY session "
    "ORDER BY max(coalesce(first_seen, last_seen, 0)) DESC, max(rank_id) DESC"
)


def latest_run(conn: sqlite3.Connection) -> RunRef | None:
    """The session that started most recently, at its highest attempt (torchelastic restarts)."""
    row = conn.execute(_SESSIONS_NEWEST_FIRST + " LIMIT 1").fetchone()
    return None if row is None else session_run(conn, row[0])


def session_run(conn: sqlite3.Connection, session: str) -> RunRef | None:
    """``session`` at its highest attempt; None when the database holds no such session."""
    (attempt,) = conn.execute("SELECT max(attempt) FROM ranks WHERE session=?", (session,)).fetchone()
    return None if attempt is None else RunRef(session, int(attempt))


def resolve_run(conn: sqlite3.Connection, session: str | None) -> RunRef | None:
    """The run a reader shows: ``session`` at its highest attempt, or the latest run when
    ``session`` is None (None then when nothing is stored). Raises UnknownSession."""
    if session is None:
        return latest_run(conn)
    run = session_run(conn, session)
    if run is None:
        raise UnknownSession(session, session_names(conn, newest_last=True))
    return run


def current_run(conn: sqlite3.Connection) -> RunRef | None:
    """``latest_run``, or None while the daemon has not created its tables yet (a live view
    may open the database first). A late resend from an earlier attempt (an elastic
    restart) refreshes that attempt's last_seen but does not make it the current run."""
    if not has_table(conn, "ranks"):
        return None
    return latest_run(conn)


def list_runs(conn: sqlite3.Connection) -> list[RunRef]:
    rows = conn.execute(
        "SELECT session, attempt FROM ranks GROUP BY session, attempt ORDER BY min(first_seen)"
    ).fetchall()
    return [RunRef(s, int(a)) for s, a in rows]


def session_names(conn: sqlite3.Connection, *, newest_last: bool = False) -> list[str]:
    """Every session: by name, or oldest to newest (``latest_run``'s order reversed)."""
    if newest_last:
        return [row[0] for row in conn.execute(_SESSIONS_NEWEST_FIRST)][::-1]
    return [row[0] for row in conn.execute("SELECT DISTINCT session FROM ranks ORDER BY session")]


def ranks_after(conn: sqlite3.Connection, rank_id: int) -> list[tuple[int, str, int]]:
    """(rank_id, session, attempt) of every rank stored after ``rank_id``: how a live
    view learns of new runs and restarts (a search of the rowid, whatever the size)."""
    return conn.execute(
        "SELECT rank_id, session, attempt FROM ranks WHERE rank_id>? ORDER BY rank_id", (rank_id,)
    ).fetchall()


@dataclass(frozen=True)
class RunInfo:
    """One run as ``traceml-daemon runs`` lists it; rank and step figures are its newest attempt's."""

    session: str
    attempts: tuple[int, ...]
    first_seen: float | None  # of any attempt
    last_seen: float | None
    ranks: int
    nodes: int
    first_step: int | None  # the lowest first step and the highest last step over its ranks
    last_step: int | None
    finished_ranks: int  # ranks whose last status said they finished

    @property
    def run(self) -> RunRef:
        return RunRef(self.session, max(self.attempts))

    def state(self, now: float) -> str:
        """finished (every rank said so), live (heard from lately), else stopped."""
        if self.ranks and self.finished_ranks >= self.ranks:
            return "finished"
        if self.last_seen is not None and now - self.last_seen < LIVE_SILENCE_S:
            return "live"
        return "stopped"


# Per session and attempt, from the ranks table alone.
_ATTEMPTS = (
    "SELECT session, attempt, count(*), count(DISTINCT node_rank), min(first_seen), max(last_seen) "
    "FROM ranks GROUP BY session, attempt"
)
# One run's step bounds and finished ranks: each MIN/MAX a seek of the steps index, the
# status a seek of its one-row-per-rank index; never a walk of a rank's steps.
_RUN_PROGRESS = (
    f"SELECT min((SELECT MIN(step) FROM steps s WHERE {rank_is('r.rank_id', 's.rank_id')})), "
    f"max((SELECT MAX(step) FROM steps s WHERE {rank_is('r.rank_id', 's.rank_id')})), "
    "coalesce(sum((SELECT max(x.finished) FROM status x WHERE x.rank_id = r.rank_id)), 0) "
    "FROM ranks r WHERE r.session=? AND r.attempt=?"
)


def run_infos(conn: sqlite3.Connection) -> list[RunInfo]:
    """Every run in the database, oldest first (by when its session was first seen)."""
    by_session: dict[str, list[tuple[int, int, int, float | None, float | None]]] = {}
    for session, attempt, ranks, nodes, first, last in conn.execute(_ATTEMPTS):
        by_session.setdefault(session, []).append((int(attempt), ranks, nodes, first, last))
    out: list[RunInfo] = []
    for session, rows in by_session.items():
        rows.sort()
        attempt, ranks, nodes, _first, _last = rows[-1]
        first_step, last_step, finished = conn.execute(_RUN_PROGRESS, (session, attempt)).fetchone()
        firsts = [r[3] for r in rows if r[3] is not None]
        lasts = [r[4] for r in rows if r[4] is not None]
        out.append(RunInfo(
            session=session,
            attempts=tuple(r[0] for r in rows),
            first_seen=min(firsts) if firsts else None,
            last_seen=max(lasts) if lasts else None,
            ranks=ranks,
            nodes=nodes,
            first_step=first_step,
            last_step=last_step,
            finished_ranks=int(finished),
        ))
    out.sort(key=lambda r: (r.first_seen is not None, r.first_seen or 0.0, r.session))
    return out


def run_last_seen(conn: sqlite3.Connection, run: RunRef) -> float | None:
    """When the daemon last heard from any rank of ``run`` (liveness)."""
    return conn.execute(
        "SELECT MAX(last_seen) FROM ranks WHERE session=? AND attempt=?", (run.session, run.attempt)
    ).fetchone()[0]


def run_bounds(conn: sqlite3.Connection, run: RunRef) -> tuple[float | None, float | None]:
    """(started_at, ended_at) wall clock: first and last step end, else first/last seen.

    Each rank's first and last step through the steps index, two lookups per rank:
    ``min(ts)`` over the run's rows read every row of a long run."""
    ends = conn.execute(
        f"SELECT (SELECT ts FROM steps WHERE {rank_is('r.rank_id')} ORDER BY step LIMIT 1), "
        f"(SELECT ts FROM steps WHERE {rank_is('r.rank_id')} ORDER BY step DESC LIMIT 1) "
        "FROM ranks r WHERE r.session=? AND r.attempt=?",
        (run.session, run.attempt),
    ).fetchall()
    firsts = [a for a, _ in ends if a is not None]
    lasts = [b for _, b in ends if b is not None]
    seen = conn.execute(
        "SELECT min(first_seen), max(last_seen) FROM ranks WHERE session=? AND attempt=?", (run.session, run.attempt)
    ).fetchone()
    return (min(firsts) if firsts else seen[0], max(lasts) if lasts else seen[1])


def run_parallelism(conn: sqlite3.Connection, run: RunRef, hello: Iterable[str | None] | None = None) -> str:
    """fsdp2 > ddp > single, from the traced models, else the hello identity.

    ``hello``: the ranks' hello parallelism when the caller has read the rows already.
    """
    found = {
        row[0]
        for row in conn.execute(
            "SELECT DISTINCT m.parallelism FROM models m JOIN ranks r USING (rank_id) WHERE r.session=? AND r.attempt=?",
            (run.session, run.attempt),
        )
    }
    if hello is None:
        hello = [
            row[0]
            for row in conn.execute(
                "SELECT DISTINCT parallelism FROM ranks WHERE session=? AND attempt=?", (run.session, run.attempt)
            )
        ]
    found |= set(hello)
    for kind in ("fsdp2", "ddp"):
        if kind in found:
            return kind
    return "single"


# Per node other than 0, the ranks first stored since a time (so an older run in the
# same file never counts) and whether each sent its last batch.
_OTHER_NODES_RANKS = """
SELECT r.node_rank, r.attempt, r.local_world_size, r.last_seen,
       coalesce((SELECT max(s.finished) FROM status s WHERE s.rank_id = r.rank_id), 0)
FROM ranks r WHERE r.first_seen >= ? AND r.node_rank > 0
"""


def other_nodes_ranks(db: str, since: float) -> list[tuple[int, int | None, int | None, float | None, int]]:
    """(node_rank, attempt, local_world_size, last_seen, finished) of every rank of
    nodes 1.. first stored at or after ``since``; empty while nothing is stored yet."""
    try:
        conn = connect_file(Path(db))
        try:
            return conn.execute(_OTHER_NODES_RANKS, (since,)).fetchall()
        finally:
            conn.close()
    except sqlite3.Error:
        return []  # no database yet, or its schema is still being created
