"""The engine and compare on the database of a real 2-rank DDP run (rank 1 has a slow collate)."""

from __future__ import annotations

from pathlib import Path

import pytest

from traceml_daemon.analysis.diff import compare_runs
from traceml_daemon.analysis.engine import diagnose
from traceml_daemon.commands.compare import load_run, main

pytestmark = pytest.mark.slow


def test_real_run_names_the_slow_dataloader_rank(real_run_db: Path) -> None:
    run, _ = load_run(str(real_run_db))
    problems = [v for v in diagnose(run) if v.severity != "info"]
    assert problems, "the slow collate of rank 1 went unnoticed"
    assert problems[0].name == "INPUT_STRAGGLER" and problems[0].scope["global_rank"] == 1


def test_real_run_compared_with_itself_is_identical(real_run_db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run, scalars = load_run(str(real_run_db))
    res = compare_runs(run, run, scalars, scalars)
    assert res["scalars"]["series_compared"] >= 2 and res["scalars"]["identical"]
    assert all(r["verdict"] is None for r in res["deltas"])
    assert main([str(real_run_db), str(real_run_db)]) == 0
    assert "identical (bitwise)" in capsys.readouterr().out
