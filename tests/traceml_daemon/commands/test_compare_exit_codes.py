"""compare's exit codes, one test each: 0 agree, 1 usage, 2 I/O, 3 damaged, 4 diverged, 5 regression."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest

from tests.support.procs import cli
from tests.traceml_daemon.commands.test_compare import LOSSES, diverged, make_db


@pytest.fixture()
def runs(tmp_path: Path) -> tuple[Path, Path]:
    # B's backward is 10 ms longer: its step time median is 10% above A's.
    return make_db(tmp_path / "a.db", 50.0, LOSSES), make_db(tmp_path / "b.db", 60.0, LOSSES)


def test_0_when_the_runs_agree_even_when_slower_without_the_flag(runs: tuple[Path, Path]) -> None:
    a, b = runs
    done = cli("compare", str(a), str(a))
    assert done.returncode == 0, done.stderr
    assert cli("compare", str(a), str(b)).returncode == 0  # a regression gates only when asked
    assert cli("compare", str(a), str(b), "--fail-on-regression", "15").returncode == 0  # +10% < 15%


def test_1_for_usage_errors(runs: tuple[Path, Path]) -> None:
    a, _ = runs
    assert cli("compare", str(a)).returncode == 1  # B missing
    assert cli("compare", str(a), str(a), "--ulp", "-1").returncode == 1
    assert cli("compare", str(a), str(a), "--ulp", "x").returncode == 1
    done = cli("compare", str(a), str(a), "--fail-on-regression", "-5")
    assert done.returncode == 1 and "--fail-on-regression" in done.stderr


def test_2_for_a_missing_database_or_session(runs: tuple[Path, Path], tmp_path: Path) -> None:
    a, _ = runs
    done = cli("compare", str(a), str(tmp_path / "nope.db"))
    assert done.returncode == 2 and "nope.db: no such file" in done.stderr
    done = cli("compare", f"{a}:no-such-session", str(a))
    assert done.returncode == 2 and "no-such-session" in done.stderr


def test_3_for_a_damaged_database(runs: tuple[Path, Path], tmp_path: Path) -> None:
    a, _ = runs
    bad = tmp_path / "bad.db"
    shutil.copyfile(a, bad)
    con = sqlite3.connect(bad)
    (page_size,) = con.execute("PRAGMA page_size").fetchone()
    (root,) = con.execute("SELECT rootpage FROM sqlite_master WHERE name = 'steps'").fetchone()
    con.close()
    data = bytearray(bad.read_bytes())
    data[(root - 1) * page_size] = 0x55  # the page type byte: no b-tree page has it
    bad.write_bytes(bytes(data))
    done = cli("compare", str(a), str(bad))
    assert done.returncode == 3, (done.stdout, done.stderr)
    assert "malformed" in done.stderr and "validate --db" in done.stderr


def test_4_when_a_logged_scalar_diverges(tmp_path: Path) -> None:
    a = make_db(tmp_path / "a.db", 50.0, LOSSES)
    b = make_db(tmp_path / "b.db", 60.0, diverged(7, 1))
    done = cli("compare", str(a), str(b), "--fail-on-regression", "1")
    assert done.returncode == 4, done.stderr  # divergence wins over the regression
    assert "first divergence at step 7" in done.stdout
    assert cli("compare", str(a), str(b), "--ulp", "1").returncode == 0  # within tolerance


def test_5_when_the_step_median_regresses_beyond_the_threshold(runs: tuple[Path, Path]) -> None:
    a, b = runs
    done = cli("compare", str(a), str(b), "--fail-on-regression", "5")
    assert done.returncode == 5, done.stderr
    assert cli("compare", str(b), str(a), "--fail-on-regression", "5").returncode == 0  # faster is fine


def test_help_lists_the_exit_codes() -> None:
    done = cli("compare", "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    for phrase in ("0 success", "1 usage error", "2 I/O error", "3 validation failure", "4 divergence",
                   "5 step time median"):
        assert phrase in text
