"""Shared fixtures: a database written by a real 2-rank DDP run, built once per
pytest session and reused by the tests that read a real run: the TUI
(tests/traceml_daemon/tui/test_real_run.py), the summary CLI
(tests/e2e/test_end_to_end.py), export (tests/traceml_daemon/commands/test_export.py)
and the analysis engine and compare (tests/traceml_daemon/analysis/test_engine_real_run.py)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.procs import EXAMPLES, DaemonProcess, base_env, torchrun, wait_for_steps

REAL_RUN_STEPS = 30


@pytest.fixture(autouse=True)
def _automatic_gc_restored() -> Iterator[None]:
    """The daemon's writer turns automatic garbage collection off process-wide until it
    is closed (IngestPolicy.gc_interval_s); a test that leaves a writer open (stalled or
    cancelled on purpose) must not leave the rest of the session without it."""
    yield
    if not gc.isenabled():
        gc.enable()


@pytest.fixture(scope="session")
def real_run_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run: real daemon, real ``torchrun --nproc-per-node 2`` gloo DDP job,
    rank 1 with a slow collate function."""
    db = tmp_path_factory.mktemp("real_run") / "run.db"
    with DaemonProcess(db) as daemon:
        env = base_env(TRACEML_DAEMON=daemon.address, TRACEML_RELAY_PORT=str(_free_port()))
        done = torchrun(EXAMPLES / "train.py", ["--steps", str(REAL_RUN_STEPS), "--slow-ranks", "1",
                                                "--slow-ms", "15"], nproc=2, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        wait_for_steps(db, ranks=2, steps=REAL_RUN_STEPS)
    return db


def _free_port() -> int:
    from tests.support.procs import free_port

    return free_port()
