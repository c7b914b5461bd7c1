"""`serve --profile-on-verdict` without processes: which rank a verdict names, each (run, rank)
asked once, a run at most MAX_PROFILES_PER_RUN times, the outcome said, a failing diagnosis
logged once."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest

from traceml_daemon.analysis.model import Verdict
from traceml_daemon.net.routes import ControlRoutes, RouteError, Sent
from traceml_daemon.net.verdict_profiles import (
    FRESH_S,
    MAX_PROFILES_PER_RUN,
    NOT_CONNECTED,
    SENT,
    TOO_OLD,
    Culprit,
    Ledger,
    VerdictProfiler,
    culprit_rank,
)
from traceml_daemon.store.read.runs import RunRef

RUN = RunRef("s1", 0)
NOW = 1_000_000.0


class Routes(ControlRoutes):
    """Every rank connected: records what would have gone down the wire."""

    def __init__(self, connected: set[int] | None = None) -> None:
        super().__init__()
        self.connected = connected
        self.requests: list[tuple[str | None, int, int]] = []

    def send(self, session: str | None, rank: int, steps: int, request_id: str) -> Sent:
        if self.connected is not None and rank not in self.connected:
            raise RouteError(f"rank {rank} of session {session} is not connected to this daemon")
        self.requests.append((session, rank, steps))
        return Sent(f"agent-{rank}", str(session))


def verdict(name: str, scope: dict[str, int], **evidence: Any) -> Verdict:
    return Verdict(name, "warn", scope, "why", evidence)


@pytest.mark.parametrize(("v", "rank"), [
    (verdict("STRAGGLER", {"global_rank": 1}), 1),
    (verdict("INPUT_STRAGGLER", {"global_rank": 3, "node_rank": 1}), 3),
    (verdict("WAIT_STRAGGLER", {}, global_rank=2), 2),
    (verdict("NODE_STRAGGLER", {"node_rank": 1}, ranks="4-7"), None),
    (verdict("NODE_STRAGGLER", {"node_rank": 1}, ranks="4-7", worst_rank=6), 6),
    (verdict("NODE_STRAGGLER", {"node_rank": 1}, ranks="5"), 5),
    (verdict("WAIT_HEAVY", {"global_rank": 1}), None),
    (verdict("COMPUTE_STRAGGLER", {"global_rank": -1}), None),
])
def test_the_rank_a_verdict_names(v: Verdict, rank: int | None) -> None:
    assert culprit_rank(v) == rank


def test_each_rank_of_a_run_is_claimed_once() -> None:
    ledger = Ledger(cap=3)
    assert ledger.claim(RUN, 1)
    assert not ledger.claim(RUN, 1)
    assert ledger.claim(RunRef("s1", 1), 1)  # a restarted attempt is another run
    assert ledger.claim(RunRef("s2", 0), 1)
    assert ledger.asked(RUN) == {1}


def test_a_run_is_capped() -> None:
    ledger = Ledger(cap=2)
    assert [ledger.claim(RUN, r) for r in (0, 1, 2, 3, 0)] == [True, True, False, False, False]
    assert ledger.asked(RUN) == {0, 1}
    assert ledger.claim(RunRef("s2", 0), 2)


def test_the_oldest_run_is_forgotten_past_the_bound() -> None:
    ledger = Ledger(cap=2, max_runs=2)
    for session in ("a", "b", "c"):
        assert ledger.claim(RunRef(session, 0), 0)
    assert ledger.asked(RunRef("a", 0)) == frozenset()
    assert not ledger.claim(RunRef("c", 0), 0)


def test_a_flapping_verdict_asks_each_rank_once_and_the_run_at_most_the_cap(caplog: pytest.LogCaptureFixture) -> None:
    routes = Routes()
    watcher = VerdictProfiler("unused.db", routes, steps=4)
    caplog.set_level(logging.INFO, "traceml_daemon.net.verdict_profiles")
    ranks = list(range(MAX_PROFILES_PER_RUN + 2))
    for _ in range(5):  # the same verdicts pass after pass, and the names alternate
        for rank in ranks:
            watcher.act([Culprit(RUN, "STRAGGLER", rank, NOW)], now=NOW)
    assert routes.requests == [("s1", r, 4) for r in ranks[:MAX_PROFILES_PER_RUN]]
    assert watcher.outcomes == {SENT: MAX_PROFILES_PER_RUN, NOT_CONNECTED: 0, TOO_OLD: 0}
    asked = [r.getMessage() for r in caplog.records if "asked for its next" in r.getMessage()]
    assert len(asked) == MAX_PROFILES_PER_RUN
    assert asked[0].startswith("profile on verdict: STRAGGLER names rank 0 of session s1: asked for its next 4 steps")
    assert asked[0].endswith("sent to agent-0")
    # Each repeat and the cap are said once, not every pass.
    assert sum("not asking again" in r.getMessage() for r in caplog.records) == MAX_PROFILES_PER_RUN
    assert sum("had its" in r.getMessage() for r in caplog.records) == 1


def test_the_outcome_tells_a_gone_rank_from_an_old_agent(caplog: pytest.LogCaptureFixture) -> None:
    watcher = VerdictProfiler("unused.db", Routes(connected=set()), steps=2)
    caplog.set_level(logging.INFO, "traceml_daemon.net.verdict_profiles")
    watcher.act([Culprit(RUN, "INPUT_STRAGGLER", 1, NOW - 10 * FRESH_S),  # no data lately: gone
                 Culprit(RUN, "COMPUTE_STRAGGLER", 2, NOW - 1.0),  # data arrives but no route takes requests
                 Culprit(RUN, "STRAGGLER", 3, None)], now=NOW)
    assert watcher.outcomes == {SENT: 0, NOT_CONNECTED: 2, TOO_OLD: 1}
    lines = [r.getMessage() for r in caplog.records]
    assert any("INPUT_STRAGGLER names rank 1" in line and ": rank not connected (" in line for line in lines)
    assert any("COMPUTE_STRAGGLER names rank 2" in line and ": agent too old (" in line for line in lines)
    # Asked once whatever the outcome: a rank that is gone is not asked every pass.
    watcher.act([Culprit(RUN, "INPUT_STRAGGLER", 1, NOW)], now=NOW)
    assert watcher.outcomes[SENT] + watcher.outcomes[NOT_CONNECTED] + watcher.outcomes[TOO_OLD] == 3


def test_a_failing_diagnosis_is_logged_once_and_the_watcher_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    routes = Routes()
    watcher = VerdictProfiler(str(tmp_path / "missing.db"), routes)
    caplog.set_level(logging.DEBUG, "traceml_daemon.net.verdict_profiles")
    for _ in range(3):
        asyncio.run(watcher.pass_once())
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(errors) == 1 and "diagnosis failed" in errors[0].getMessage()
    assert routes.requests == []
