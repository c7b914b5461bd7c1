"""Every per-rank read of the telemetry tables searches its ``{table}_by_group`` index.

Since schema v4 the per-rank indexes are keyed by rank group (store/schema.py:
``RANK_GROUP``), and SQLite uses them only when a query says both the group and
the rank (``schema.rank_is``). A read written ``WHERE rank_id=?`` still returns
the right rows, by scanning the whole table: nothing else would catch it. So this
runs the real readers (summary, TUI refresh and analyzer, export, compare, live
metrics), which all read through the read layer (``store.read``, ``store.reader``),
on a run of two groups' worth of ranks, records every statement they execute, and
asks SQLite for the plan of each one that touches a grouped table.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tests.support import synth_db as synth
from traceml_daemon.commands import cli
from traceml_daemon.metrics.collect import read_db_state
from traceml_daemon.store.schema import GROUPED_INDEXES, RANK_GROUP, SCHEMA_VERSION, rank_is, ranks_in
from traceml_daemon.tui.analyzer import Analyzer
from traceml_daemon.tui.data import TuiData, read_runs

# A plan line that reads a grouped table whole: the table, or all of an index. A per-rank
# read says SEARCH.
_FULL_SCAN = re.compile(rf"\bSCAN ({'|'.join(GROUPED_INDEXES)}|s|m|x)\b")
# The statements that scan on purpose: schema migrations and history backfill (GROUP BY
# over every row once), retention's deletes.
_WHOLE_RUN = ("INSERT", "CREATE", "DELETE", "PRAGMA")
# compare reads every step and scalar of both runs, in one pass each.
_WHOLE_RUN_READS = ("FROM steps s JOIN ranks r", "FROM scalars s JOIN ranks r")


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every SQL statement executed through any sqlite3 connection opened meanwhile."""
    seen: list[str] = []
    real_connect = sqlite3.connect

    def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        con = real_connect(*args, **kwargs)
        con.set_trace_callback(seen.append)  # expanded SQL: the bound values inlined
        return con

    monkeypatch.setattr(sqlite3, "connect", connect)
    return seen


def _run(path: Path, session: str) -> str:
    # 2 nodes x 9 ranks: three rank groups, the last one partly filled.
    spec = synth.SynthSpec(nnodes=2, ranks_per_node=9, steps=120, session=session)
    return synth.build(str(path), spec)


def _plans(db: str, statements: list[str]) -> list[tuple[str, str]]:
    """(statement, plan line) for each plan line that scans a grouped table."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    bad = []
    try:
        for sql in dict.fromkeys(statements):
            if not any(re.search(rf"\b{t}\b", sql) for t in GROUPED_INDEXES):
                continue
            if sql.lstrip().upper().startswith(_WHOLE_RUN) or any(w in sql for w in _WHOLE_RUN_READS):
                continue
            if "rowid>" in sql.replace(" ", ""):
                continue  # the TUI's tail of new rows: a rowid range, searched by rowid
            for row in con.execute(f"EXPLAIN QUERY PLAN {sql}"):
                if _FULL_SCAN.search(row[3]):
                    bad.append((sql, row[3]))
    finally:
        con.close()
    return bad


def test_database_has_the_grouped_indexes_only(tmp_path: Path) -> None:
    db = _run(tmp_path / "a.db", "run-a")
    con = sqlite3.connect(db)
    indexes = {name for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    version = con.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0]
    con.close()
    assert int(version) == SCHEMA_VERSION
    for table in GROUPED_INDEXES:
        assert f"{table}_by_group" in indexes
        assert f"{table}_by_rank" not in indexes


def test_every_reader_searches_the_grouped_indexes(tmp_path: Path, recorded: list[str]) -> None:
    a = _run(tmp_path / "a.db", "run-a")
    b = _run(tmp_path / "b.db", "run-b")
    recorded.clear()  # building is not reading
    assert cli.main(["summary", "--db", a, "--json"]) == 0
    assert cli.main(["export", "--db", a, "--format", "chrome", str(tmp_path / "t.json")]) == 0
    assert cli.main(["export", "--db", a, "--format", "csv", str(tmp_path / "t.csv")]) == 0
    assert cli.main(["export", "--db", a, "--format", "chrome", "--steps", "10:20", str(tmp_path / "u.json")]) == 0
    assert cli.main(["compare", a, b, "--json"]) == 0
    # Runs as first-class: the listing (ranks, step bounds, each run's newest steps
    # diagnosed) and every reader asked for a session by name.
    assert cli.main(["runs", "--db", a, "--json"]) == 0
    assert cli.main(["summary", "--db", a, "--json", "--no-files", "--session", "run-a"]) == 0
    assert cli.main(["compare", f"{a}:run-a", f"{b}:run-b", "--json"]) == 0
    assert cli.main(["export", "--db", a, "--format", "csv", "--session", "run-a", str(tmp_path / "s.csv")]) == 0
    runs, latest = read_runs(a)  # the TUI's run picker
    assert [r.session for r in runs] == ["run-a"] and latest is not None
    state = read_db_state(a, set(range(1, 19)))  # the /metrics endpoint's database read
    assert state.nodes
    data = TuiData(a, session="run-a")
    try:
        data.overview()
        for node in (0, 1):
            assert data.node_detail(node) is not None
        for global_rank in (0, 8, 17):
            detail = data.rank_detail(global_rank)
            assert detail is not None and detail.phase_series
    finally:
        data.close()
    analyzer = Analyzer(a)
    try:
        assert analyzer.run(latest).nodes
    finally:
        analyzer.close()
    grouped = [sql for sql in recorded if re.search(rf"\b({'|'.join(GROUPED_INDEXES)})\b", sql)]
    assert len(grouped) > 20  # the readers ran and were recorded
    # Every telemetry table was read, so every reader's statements were planned.
    read = {t for t in GROUPED_INDEXES if any(re.search(rf"\bFROM {t}\b", sql) for sql in recorded)}
    assert read == set(GROUPED_INDEXES)
    assert _plans(a, recorded) == []


def test_rank_is_selects_exactly_one_rank(tmp_path: Path) -> None:
    db = _run(tmp_path / "a.db", "run-a")
    con = sqlite3.connect(db)
    try:
        for rank_id in range(1, 19):
            got = con.execute(f"SELECT count(*), min(rank_id), max(rank_id) FROM steps WHERE {rank_is('?1')}",
                              (rank_id,)).fetchone()
            assert got == (120, rank_id, rank_id)
        # Neighbours across a group boundary, and a rank id with no rows.
        ids = (RANK_GROUP - 1, RANK_GROUP, 2 * RANK_GROUP + 1, 999)
        got = con.execute(f"SELECT DISTINCT rank_id FROM steps WHERE {ranks_in(len(ids))} ORDER BY 1", ids).fetchall()
        assert [r for (r,) in got] == list(ids[:3])
        plan = " ".join(row[3] for row in con.execute(
            f"EXPLAIN QUERY PLAN SELECT step FROM steps WHERE {rank_is('?1')} ORDER BY step DESC LIMIT 5", (3,)))
        assert "steps_by_group" in plan and "TEMP B-TREE" not in plan
    finally:
        con.close()
