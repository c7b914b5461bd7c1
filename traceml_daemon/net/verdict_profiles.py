"""`traceml-daemon serve --profile-on-verdict [K]`: profile the rank a straggler verdict names.

While serving, the daemon diagnoses each live run every ``INTERVAL_S`` (the newest
``DIAGNOSIS_WINDOW`` steps per rank, read-only, in a worker thread: ingest never
waits for it). The first time a straggler verdict (STRAGGLER, INPUT_/H2D_/COMPUTE_/
WAIT_STRAGGLER; for NODE_STRAGGLER the node's ``worst_rank``) names a rank
of a run, the daemon asks that rank to record its next K steps with torch.profiler,
down the same route as `traceml-daemon profile` (``ControlRoutes.send``). Each
(run, rank) is asked once for the daemon's lifetime and a run at most
``MAX_PROFILES_PER_RUN`` times, so a flapping verdict never floods ranks with
profiler work. Each request is logged with its verdict, rank and outcome.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from traceml_daemon.analysis.model import Verdict
from traceml_daemon.analysis.policy import Policy
from traceml_daemon.store.read.runs import RunRef
from traceml_wire.printable import printable

if TYPE_CHECKING:  # the command line reads this module's defaults without the wire stack
    from traceml_daemon.net.routes import ControlRoutes

log = logging.getLogger("traceml_daemon.net.verdict_profiles")

DEFAULT_STEPS = 5  # K of a bare --profile-on-verdict
INTERVAL_S = 5.0  # between two diagnoses of the live runs
DIAGNOSIS_WINDOW = 200  # newest steps per rank diagnosed, like /metrics and the live TUI
LIVE_S = 60.0  # a run is live while data of one of its ranks arrived this recently
MAX_RUNS_PER_PASS = 8  # live runs diagnosed per pass, most recently heard from first
MAX_PROFILES_PER_RUN = 3  # requests per run for the daemon's lifetime
MAX_RUNS_REMEMBERED = 4096  # runs whose requests are remembered; the oldest is forgotten past this
FRESH_S = 2 * INTERVAL_S  # data this recent with no control route: the rank's agent or relay is too old

SENT = "sent"
NOT_CONNECTED = "rank not connected"
TOO_OLD = "agent too old"


@dataclass(frozen=True)
class Culprit:
    """A rank a straggler verdict of a live run names."""

    run: RunRef
    verdict: str
    rank: int
    last_seen: float | None  # when the rank's data last arrived (tells "too old" from "gone")


def culprit_rank(verdict: Verdict) -> int | None:
    """The global rank a straggler verdict names; None for other verdicts, and for a
    NODE_STRAGGLER whose evidence names no single rank."""
    if not verdict.name.endswith("STRAGGLER"):
        return None
    if verdict.name == "NODE_STRAGGLER":
        for key in ("worst_rank", "global_rank"):
            if (rank := _rank(verdict.evidence.get(key))) is not None:
                return rank
        ranks = verdict.evidence.get("ranks")  # "0-3" for a node of four: no single rank to pick
        return int(ranks) if isinstance(ranks, str) and ranks.isdigit() else _rank(ranks)
    scoped = _rank(verdict.scope.get("global_rank"))
    return scoped if scoped is not None else _rank(verdict.evidence.get("global_rank"))


def _rank(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def find_culprits(db_path: str, policy: Policy | None, now: float | None = None) -> list[Culprit]:
    """The ranks the straggler verdicts of the live runs name (worker thread; read-only)."""
    from traceml_daemon.analysis.engine import diagnose
    from traceml_daemon.store import reader

    now = time.time() if now is None else now
    conn = reader.open_readonly(db_path)
    try:
        heard: dict[RunRef, float] = {}
        seen_by_run: dict[RunRef, dict[int, float]] = {}  # per run, when each global rank was last heard
        for row in reader.all_ranks(conn):
            if row.last_seen is None:
                continue
            run = RunRef(row.session, int(row.attempt or 0))
            if now - row.last_seen <= LIVE_S:
                heard[run] = max(heard.get(run, 0.0), row.last_seen)
            if row.global_rank is not None:
                seen = seen_by_run.setdefault(run, {})
                seen[row.global_rank] = max(seen.get(row.global_rank, 0.0), row.last_seen)
        runs = sorted(heard, key=heard.__getitem__, reverse=True)[:MAX_RUNS_PER_PASS]
        out: list[Culprit] = []
        for run in runs:
            seen = seen_by_run.get(run, {})
            data = reader.load_run(conn, run, last_n=DIAGNOSIS_WINDOW, live=True)
            for verdict in diagnose(data, policy):
                rank = culprit_rank(verdict)
                if rank is not None:
                    out.append(Culprit(run, verdict.name, rank, seen.get(rank)))
        return out
    finally:
        conn.close()


class Ledger:
    """Which ranks of which runs were asked: once per (run, rank), at most ``cap`` per run."""

    def __init__(self, cap: int = MAX_PROFILES_PER_RUN, max_runs: int = MAX_RUNS_REMEMBERED) -> None:
        self.cap = cap
        self.max_runs = max_runs
        self._asked: OrderedDict[RunRef, set[int]] = OrderedDict()
        self._said: set[tuple[RunRef, int | None]] = set()  # (run, rank) repeats logged; (run, None): cap logged

    def claim(self, run: RunRef, rank: int) -> bool:
        """True once for (run, rank) while the run is under its cap; every later call False."""
        asked = self._asked.get(run)
        if asked is None:
            asked = self._asked[run] = set()
            while len(self._asked) > self.max_runs:
                old, _ = self._asked.popitem(last=False)
                self._said = {k for k in self._said if k[0] != old}
        if rank in asked or len(asked) >= self.cap:
            return False
        asked.add(rank)
        return True

    def asked(self, run: RunRef) -> frozenset[int]:
        return frozenset(self._asked.get(run, ()))

    def first_time(self, run: RunRef, rank: int | None) -> bool:
        """True the first time a refusal of (run, rank) is to be logged (rank None: the run's cap)."""
        if (run, rank) in self._said:
            return False
        self._said.add((run, rank))
        return True


class VerdictProfiler:
    """The serve process's watcher: diagnose, then ask each named rank once."""

    def __init__(self, db_path: str, routes: ControlRoutes, steps: int = DEFAULT_STEPS,
                 policy: Policy | None = None, ledger: Ledger | None = None) -> None:
        self.db_path = db_path
        self.routes = routes
        self.steps = steps
        self.policy = policy
        self.ledger = ledger or Ledger()
        self.outcomes: dict[str, int] = {SENT: 0, NOT_CONNECTED: 0, TOO_OLD: 0}
        self._failed = False  # a diagnosis failure is logged once, then at debug

    async def run(self) -> None:
        log.info("profile on verdict: a rank a straggler verdict names records its next %d steps "
                 "(once per rank, at most %d per run)", self.steps, self.ledger.cap)
        while True:
            await asyncio.sleep(INTERVAL_S)
            await self.pass_once()

    async def pass_once(self) -> None:
        """One diagnosis of the live runs, and the requests it calls for."""
        try:
            culprits = await asyncio.to_thread(find_culprits, self.db_path, self.policy)
        except Exception:  # the watcher must never take the daemon down, nor flood its log
            if not self._failed:
                self._failed = True
                log.exception("profile on verdict: diagnosis failed (logged once; trying again every %.0f s)",
                              INTERVAL_S)
            else:
                log.debug("profile on verdict: diagnosis failed again", exc_info=True)
            return
        self.act(culprits)

    def act(self, culprits: list[Culprit], now: float | None = None) -> None:
        """Ask each culprit not asked before (event loop thread: ``routes`` is not shared)."""
        for c in culprits:
            if self.ledger.claim(c.run, c.rank):
                self._ask(c, time.time() if now is None else now)
            elif c.rank in self.ledger.asked(c.run):
                if self.ledger.first_time(c.run, c.rank):
                    log.info("profile on verdict: %s still names rank %d of session %s; profiled once already, "
                             "not asking again", c.verdict, c.rank, printable(c.run.session))
            elif self.ledger.first_time(c.run, None):
                log.info("profile on verdict: session %s had its %d profiles; %s names rank %d, not asked",
                         printable(c.run.session), self.ledger.cap, c.verdict, c.rank)

    def _ask(self, c: Culprit, now: float) -> str:
        from traceml_daemon.net.routes import RouteError

        request_id = secrets.token_hex(8)
        detail = ""
        try:
            sent = self.routes.send(c.run.session, c.rank, self.steps, request_id)
            outcome, detail = SENT, f" to {printable(sent.sender)}"
        except RouteError as exc:
            fresh = c.last_seen is not None and now - c.last_seen <= FRESH_S
            # Its data still arrives but no connection that takes control requests carries it.
            outcome = TOO_OLD if fresh and "not connected" in str(exc) else NOT_CONNECTED
            detail = (" (its data arrives, over a connection that takes no control requests: an older agent or "
                      "relay)" if outcome == TOO_OLD else f" ({printable(str(exc))})")
        self.outcomes[outcome] += 1
        log.info("profile on verdict: %s names rank %d of session %s: asked for its next %d steps (request %s): "
                 "%s%s", c.verdict, c.rank, printable(c.run.session), self.steps, request_id, outcome, detail)
        return outcome
