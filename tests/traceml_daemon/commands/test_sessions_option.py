"""Choosing a run: the latest run with jobs running at once, ``--session`` errors,
compare's ``PATH:SESSION`` sides, and the TUI's run choice (restarts followed,
other jobs announced, a pinned session awaited)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from traceml_daemon.commands.compare import split_side
from traceml_daemon.store.migrations import MIGRATIONS
from traceml_daemon.store.read.runs import RunRef, UnknownSession, latest_run, resolve_run, run_infos
from traceml_daemon.tui.follow import RunChoice


def empty_db(path: Path) -> sqlite3.Connection:
    con = sqlite3.connect(path)
    for step in MIGRATIONS:
        for sql in step:
            con.execute(sql)
    return con


def add_rank(con: sqlite3.Connection, session: str, attempt: int, rank: int, seen: float) -> None:
    con.execute(
        "INSERT INTO ranks (sender, session, attempt, global_rank, node_rank, first_seen, last_seen) "
        "VALUES (?, ?, ?, ?, 0, ?, ?)",
        (f"{session}/a{attempt}/n0/r{rank}/1-x", session, attempt, rank, seen, seen),
    )
    con.commit()


def test_split_side(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for name in ("a.db", "x:y.db", "x"):
        Path(name).write_bytes(b"")
    assert split_side("a.db") == ("a.db", None)
    assert split_side("a.db:job-1") == ("a.db", "job-1")
    assert split_side("a.db:10.0.0.7:29500") == ("a.db", "10.0.0.7:29500")  # a session id may hold ':'
    assert split_side("a.db:") == ("a.db", None)
    assert split_side("x:y.db") == ("x:y.db", None)  # an existing file wins
    assert split_side("x:y.db:s") == ("x:y.db", "s")  # the longest path that exists
    assert split_side("nope.db:s") == ("nope.db:s", None)  # reading it then says: no such file
    assert split_side(str(tmp_path / "a.db") + ":s") == (str(tmp_path / "a.db"), "s")


def test_latest_run_is_the_newest_job_whichever_reported_last(tmp_path: Path) -> None:
    con = empty_db(tmp_path / "h.db")
    add_rank(con, "old", 0, 0, 100.0)
    add_rank(con, "new", 0, 0, 200.0)
    assert latest_run(con) == RunRef("new", 0)
    # The older job keeps reporting: it stays the older one (ordering by last_seen flipped here).
    con.execute("UPDATE ranks SET last_seen = 900.0 WHERE session = 'old'")
    con.commit()
    assert latest_run(con) == RunRef("new", 0)
    # A restart of the older job brings a new rank row: it is now the one that started last.
    add_rank(con, "old", 1, 0, 300.0)
    assert latest_run(con) == RunRef("old", 1)
    assert resolve_run(con, "new") == RunRef("new", 0) and resolve_run(con, None) == RunRef("old", 1)
    infos = run_infos(con)
    assert [(i.session, i.attempts, i.first_seen, i.last_seen) for i in infos] == [
        ("old", (0, 1), 100.0, 900.0), ("new", (0,), 200.0, 200.0)]
    assert infos[0].state(now=900.0 + 1) == "live" and infos[1].state(now=900.0) == "stopped"
    con.close()


def test_an_unknown_session_names_the_newest_sessions(tmp_path: Path) -> None:
    con = empty_db(tmp_path / "h.db")
    with pytest.raises(UnknownSession, match=r"no session 'x' in the database \(sessions: none\)"):
        resolve_run(con, "x")
    for i in range(25):
        add_rank(con, f"job-{i:02d}", 0, 0, float(i))
    with pytest.raises(UnknownSession) as caught:
        resolve_run(con, "x")
    message = str(caught.value)
    assert "job-24" in message and "job-05" in message and "job-04" not in message
    assert "and 5 older: `traceml-daemon runs` lists all" in message
    assert caught.value.known[0] == "job-00" and len(caught.value.known) == 25
    con.close()


def test_run_choice_follows_restarts_and_announces_other_jobs(tmp_path: Path) -> None:
    con = empty_db(tmp_path / "h.db")
    follow, pinned = RunChoice(), RunChoice("job-b")
    assert follow.choose(con) is None and pinned.choose(con) is None  # nothing stored yet
    add_rank(con, "job-a", 0, 0, 1.0)
    # The first run stored is adopted, not announced; the pinned view still waits for its own.
    assert follow.choose(con) == RunRef("job-a", 0) and follow.new_runs == []
    assert pinned.choose(con) is None
    add_rank(con, "job-b", 0, 0, 2.0)
    assert follow.choose(con) == RunRef("job-a", 0) and follow.new_runs == ["job-b"]
    assert pinned.choose(con) == RunRef("job-b", 0) and pinned.new_runs == ["job-a"]
    add_rank(con, "job-a", 1, 0, 3.0)  # job A restarts: the same job, followed
    assert follow.choose(con) == RunRef("job-a", 1)
    follow.request("job-b")
    assert follow.choose(con) == RunRef("job-b", 0) and follow.new_runs == []
    add_rank(con, "job-c", 0, 0, 4.0)
    follow.request(None)  # follow the latest again
    assert follow.choose(con) == RunRef("job-c", 0) and follow.new_runs == []  # job B was shown: not new
    con.close()


def test_run_choice_counts_runs_there_at_the_first_look_as_old(tmp_path: Path) -> None:
    con = empty_db(tmp_path / "h.db")
    add_rank(con, "job-a", 0, 0, 1.0)
    add_rank(con, "job-b", 0, 0, 2.0)
    choice = RunChoice()
    assert choice.choose(con) == RunRef("job-b", 0) and choice.new_runs == []
    con.close()
