"""`traceml-daemon runs --db PATH [--json] [--no-verdicts]`: the runs (sessions) a database holds.

One line per session, oldest first: its attempts, when it was first and last
seen, ranks and nodes and the steps they reached (its newest attempt), whether
it is live, finished or stopped, and how many verdicts the analysis engine gives.
The latest run, the one every reader shows without ``--session``, is marked.

Every read is bounded: the ``ranks`` table, two index seeks per rank for the
step bounds, and for the verdicts each run's newest steps (``reader.load_run``
with ``last_n``), at most about ``VERDICT_BUDGET_ROWS`` rows a run; so the
counts are of the run as it is now, and ``summary --session ID`` lists the
verdicts of the whole run. ``--no-verdicts`` reads the ``ranks`` table and the
step bounds only.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from traceml_daemon.analysis.model import Verdict
from traceml_daemon.store import reader
from traceml_daemon.store.gc_pause import gc_paused
from traceml_daemon.store.read.runs import RunInfo, latest_run, run_infos
from traceml_wire.printable import printable, printable_text

DEFAULT_DB = "traceml.db"
# Step rows each run's diagnosis may read: its ranks share them, each rank between
# VERDICT_MIN_STEPS (enough to leave warm-up) and VERDICT_MAX_STEPS of its newest steps.
VERDICT_BUDGET_ROWS = 200_000
VERDICT_MIN_STEPS = 64
VERDICT_MAX_STEPS = reader.SAMPLE_TAIL_STEPS

log = logging.getLogger("traceml_daemon.commands.runs")


def verdict_steps(ranks: int) -> int:
    """The newest steps per rank a run of ``ranks`` ranks is diagnosed over."""
    return max(VERDICT_MIN_STEPS, min(VERDICT_MAX_STEPS, VERDICT_BUDGET_ROWS // max(1, ranks)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``runs`` subcommand's arguments (called by traceml_daemon.commands.cli)."""
    parser.add_argument("--db", default=DEFAULT_DB, help=f"database (default ./{DEFAULT_DB})")
    parser.add_argument("--json", action="store_true", help="print JSON on stdout")
    parser.add_argument("--no-verdicts", action="store_true",
                        help="do not diagnose the runs (reads only the ranks table and each rank's step bounds)")


def _diagnose(conn: Any, info: RunInfo, now: float) -> list[Verdict] | None:
    """Verdicts over the run's newest steps; None when the engine failed (named in the log)."""
    from traceml_daemon.analysis.engine import diagnose

    try:
        data = reader.load_run(conn, info.run, last_n=verdict_steps(info.ranks))
        # The summary's rule: a rank that has not said it finished makes the run live, so
        # the liveness verdicts (RANK_STALLED, HANG) count here as they do there.
        if any(r.status is not None and not r.status.finished for r in data.ranks):
            data.live, data.now = True, now
        return list(diagnose(data))
    except Exception:
        log.exception("diagnosis of session %s failed", printable(info.session))
        return None


def list_runs(db_path: str, verdicts: bool = True, now: float | None = None) -> dict[str, Any]:
    """Every run of the database at ``db_path`` as a JSON-able dict. Raises reader.StoreError."""
    now = time.time() if now is None else now
    with gc_paused():  # diagnosis loads many small acyclic rows (see gc_pause)
        conn = reader.open_readonly(db_path)
        try:
            infos = run_infos(conn)
            latest = latest_run(conn)
            runs = []
            for info in infos:
                found = _diagnose(conn, info, now) if verdicts else None
                state = info.state(now)
                runs.append({
                    "session": info.session,
                    "attempt": info.run.attempt,
                    "attempts": list(info.attempts),
                    "first_seen": info.first_seen,
                    "last_seen": info.last_seen,
                    "ranks": info.ranks,
                    "nodes": info.nodes,
                    "first_step": info.first_step,
                    "last_step": info.last_step,
                    "state": state,
                    "live": state == "live",
                    "latest": latest is not None and info.session == latest.session,
                    "verdicts": None if found is None else len(found),
                    "verdict_names": None if found is None else [v.name for v in found],
                    "verdicts_steps": verdict_steps(info.ranks) if verdicts else None,
                })
        finally:
            conn.close()
    return {
        "db": os.path.abspath(db_path),
        "latest": latest.session if latest is not None else None,
        "verdicts_from": (
            "each run's newest steps, verdicts_steps a rank; `summary --session ID` diagnoses the whole run"
            if verdicts else None
        ),
        "runs": runs,
    }


def _when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _steps(run: dict[str, Any]) -> str:
    first, last = run["first_step"], run["last_step"]
    return "-" if last is None else f"{first}-{last}"


def _verdict_cell(run: dict[str, Any]) -> str:
    if run["verdicts"] is None:
        return "-"
    names = ", ".join(run["verdict_names"][:3]) + (", ..." if run["verdicts"] > 3 else "")
    return f"{run['verdicts']} ({names})" if names else "0"


def render_text(listing: dict[str, Any]) -> str:
    """A table, oldest run first; ``*`` marks the latest (what readers show without --session)."""
    headers = ["", "session", "attempts", "first seen", "last seen", "ranks", "nodes", "steps", "state", "verdicts"]
    rows = [
        [
            "*" if run["latest"] else "",
            run["session"],
            ",".join(str(a) for a in run["attempts"]),
            _when(run["first_seen"]),
            _when(run["last_seen"]),
            str(run["ranks"]),
            str(run["nodes"]),
            _steps(run),
            run["state"],
            _verdict_cell(run),
        ]
        for run in listing["runs"]
    ]
    lines = [f"Runs in {listing['db']} (oldest first; * the latest: what readers show without --session)"]
    lines += _table(headers, rows)
    if not rows:
        lines.append("(no runs stored yet)")
    if listing["verdicts_from"]:
        lines.append("verdicts: over each run's newest steps (up to "
                     f"{VERDICT_MAX_STEPS:,} a rank); `summary --session ID` diagnoses the whole run")
    # Sessions and hostnames are peer text: no escape sequence reaches the terminal.
    return printable_text("\n".join(lines)) + "\n"


def _table(headers: Sequence[str], rows: list[list[str]]) -> list[str]:
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    numeric = {"ranks", "nodes"}

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if h in numeric else c.ljust(w) for c, w, h in zip(cells, widths, headers, strict=True)
        ).rstrip()

    return [line(headers), "-" * len(line(headers)), *(line(r) for r in rows)]


def main(args: argparse.Namespace | list[str] | None = None) -> int:
    """List the runs: ``args`` parsed by the CLI, or a raw argument list (tests)."""
    if not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(prog="traceml-daemon runs", description="List the runs in a database.")
        add_arguments(parser)
        args = parser.parse_args(args)
    try:
        listing = list_runs(args.db, verdicts=not args.no_verdicts)
    except reader.StoreError as exc:
        print(f"traceml-daemon runs: {exc}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(listing, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_text(listing))
    return 0


if __name__ == "__main__":
    sys.exit(main())
