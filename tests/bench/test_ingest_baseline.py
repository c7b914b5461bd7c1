"""bench/ingest.py: the plain sqlite3 baseline inserts the rows a case sends, in the
order the daemon gets them (the ``(rank_id, step)`` index makes order a workload)."""

from __future__ import annotations

import importlib.util
import random
import sqlite3
import sys
from pathlib import Path
from typing import Any

import pytest

from traceml_daemon.store.migrations import MIGRATIONS
from traceml_wire.tables import columns, decode_body

_SPEC = importlib.util.spec_from_file_location("bench_ingest", Path(__file__).parents[2] / "bench" / "ingest.py")
assert _SPEC is not None and _SPEC.loader is not None
bench_ingest = importlib.util.module_from_spec(_SPEC)
sys.modules["bench_ingest"] = bench_ingest
_SPEC.loader.exec_module(bench_ingest)


def test_baseline_rows_come_flush_after_flush_each_rank_a_run_of_its_steps() -> None:
    rows = bench_ingest.baseline_rows(total_rows=3 * 4 * 5 + 7, ranks=4, steps_per_flush=5)
    assert len(rows) == 67
    width = 1 + len(columns("steps"))
    assert {len(r) for r in rows} == {width}
    keys = [(r[0], r[1]) for r in rows]
    # Round one: rank 1's steps 0-4, then rank 2's, ...; round two starts at step 5.
    assert keys[:10] == [(1, s) for s in range(5)] + [(2, s) for s in range(5)]
    assert keys[20:25] == [(1, s) for s in range(5, 10)]
    assert len(set(keys)) == len(keys)  # no (rank, step) twice


def test_a_simulated_flush_holds_the_steps_the_baseline_inserts_for_it() -> None:
    mix = bench_ingest.AgentMix(steps_per_flush=300)
    body = bench_ingest.BodyMaker(random.Random(0), mix).body(first_step=600, n=300, flush=2, leader=True)
    steps = decode_body(body)["steps"]
    assert list(steps["step"]) == list(range(600, 900))
    assert set(steps) == set(columns("steps"))


def test_baseline_rows_fit_the_schema_the_daemon_writes(tmp_path: Path) -> None:
    rows = bench_ingest.baseline_rows(500, ranks=8, steps_per_flush=10)
    conn = sqlite3.connect(tmp_path / "check.db")
    for stmt in MIGRATIONS[0]:
        conn.execute(stmt)
    cols = ("rank_id",) + columns("steps")
    conn.executemany(f"INSERT INTO steps ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})", rows)
    assert conn.execute("SELECT count(*), count(DISTINCT rank_id), max(step) FROM steps").fetchone() == (500, 8, 69)


def test_the_baseline_writes_into_the_daemons_current_schema(tmp_path: Path, monkeypatch: Any) -> None:
    from traceml_daemon.store.schema import SCHEMA_VERSION

    made: list[tuple[int, set[str]]] = []
    real_migrate = bench_ingest.migrate

    def checked_migrate(path: str) -> None:
        real_migrate(path)
        with sqlite3.connect(path) as conn:
            version = int(conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()[0])
            indexes = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE tbl_name='steps' AND type='index'")}
        made.append((version, indexes))

    monkeypatch.setattr(bench_ingest, "migrate", checked_migrate)
    assert bench_ingest.sqlite_baseline(2_000, tmp_path, ranks=8, steps_per_flush=10) > 0
    assert made == [(SCHEMA_VERSION, {"steps_by_group"})]


def test_repeated_rounds_report_medians_and_paired_differences(capsys: Any) -> None:
    """``--repeat``: each figure's median over the rounds, every round's figures kept,
    and the per-round difference to the --versus twin (rounds missing a figure skipped)."""
    tag = "r8_throughput"
    rounds: list[dict[str, float | None]] = [
        {f"{tag}_rows_per_s": 100.0, f"{tag}_ratio": 0.5, f"{tag}_versus_rows_per_s": 90.0, f"{tag}_versus_ratio": 0.4},
        {f"{tag}_rows_per_s": 300.0, f"{tag}_ratio": 0.7, f"{tag}_versus_rows_per_s": 310.0, f"{tag}_versus_ratio": 0.8},
        {f"{tag}_rows_per_s": 200.0, f"{tag}_ratio": 0.6, f"{tag}_versus_rows_per_s": 150.0, f"{tag}_versus_ratio": None},
    ]
    out = bench_ingest._rounds_summary(tag, "throughput", rounds, compare=True)
    assert out[f"{tag}_rows_per_s"] == 200.0
    assert out[f"{tag}_versus_rows_per_s"] == 150.0
    assert out[f"{tag}_ratio"] == 0.6
    assert out[f"{tag}_versus_ratio"] == pytest.approx(0.6)  # the median of the two rounds that have it
    assert out[f"{tag}_rows_per_s_minus_versus_median"] == 10.0  # of +10, -10, +50
    assert out[f"{tag}_ratio_minus_versus_median"] == pytest.approx(0.0)  # of +0.1, -0.1 (round 3 has no versus ratio)
    assert [out[f"{tag}_rows_per_s_round{i}"] for i in (1, 2, 3)] == [100.0, 300.0, 200.0]
    printed = capsys.readouterr().out
    assert "3 rounds, this daemon: step rows/s median 200 (min 100, max 300)" in printed
    assert "paired by round: step rows/s median +10" in printed
