"""The step inspector's and the output readers' statements search the per-rank indexes:
none scans a telemetry table (a run of any length costs them index seeks)."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tests.support.synth_db import T0, SynthSpec, build
from traceml_daemon.store.read import output
from traceml_daemon.store.read.runs import latest_run
from traceml_daemon.store.read.step_detail import load_step

_TELEMETRY = ("steps", "scalars", "layers", "spans", "process", "system", "gpu", "output", "status")
_SCAN = re.compile(rf"\bSCAN ({'|'.join(_TELEMETRY)})\b")


@pytest.fixture
def db(tmp_path: Path) -> str:
    # 2 nodes x 9 ranks: three rank groups, the last one partly filled.
    path = build(str(tmp_path / "run.db"), SynthSpec(nnodes=2, ranks_per_node=9, steps=120))
    con = sqlite3.connect(path)
    con.executemany("INSERT INTO output (rank_id, ts, stream, seq, line) VALUES (?, ?, 'stdout', ?, 'x')",
                    [(g + 1, T0 + s * 0.05, s) for g in range(18) for s in range(120)])
    con.commit()
    con.close()
    return path


def test_no_evidence_read_scans_a_telemetry_table(db: str) -> None:
    seen: list[str] = []
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    con.set_trace_callback(seen.append)
    run = latest_run(con)
    assert run is not None
    view = load_step(con, run, 60, rank=10)
    assert sum(1 for _, rs in view.ranks if rs.recorded) == 18
    detail = next(rs for row, rs in view.ranks if row.global_rank == 10)
    assert detail.scalars and detail.process is not None and detail.output
    output.rank_output(con, 11, 50)
    output.first_failure(con, [(r.rank_id, r.global_rank or 0) for r, _ in view.ranks])
    bad: list[tuple[str, Any]] = []
    for sql in dict.fromkeys(seen):
        if not sql.lstrip().upper().startswith("SELECT"):
            continue
        for row in con.execute(f"EXPLAIN QUERY PLAN {sql}"):
            if _SCAN.search(row[3]):
                bad.append((sql, row[3]))
    con.close()
    assert bad == []
