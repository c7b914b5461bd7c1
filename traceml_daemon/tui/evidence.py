"""What the step inspector and the Logs screen read (stdlib sqlite3, no Textual):
the step to open, the step itself (``store.read.step_detail``) and the ranks'
output folded across ranks. Every statement is the read layer's; each call opens
its own read-only connection, so a screen's worker never shares the app's."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from traceml_daemon.analysis.output_fold import Folded, OutputLine, fold
from traceml_daemon.store import reader
from traceml_daemon.store.read import fsdp2, output, steps
from traceml_daemon.store.read.connect import connect
from traceml_daemon.store.read.runs import RunRef
from traceml_daemon.store.read.step_detail import StepView, load_step

# Recent steps per rank a verdict's step is looked for in.
VERDICT_WINDOW = 64
LOG_LINES = 50_000  # lines the Logs screen reads at most, shared by the ranks
MIN_LOG_LINES_PER_RANK = 100


@dataclass(frozen=True)
class StepPick:
    """Which step to open, and how it was chosen (shown under the title)."""

    step: int | None
    why: str


def default_step(db_path: str, run: RunRef, rank: int | None = None) -> StepPick:
    """The newest step every rank recorded, or ``rank``'s newest step."""
    conn = connect(db_path)
    try:
        rows = reader.load_ranks(conn, run)
        ids = {r.rank_id for r in rows if rank is None or r.global_rank == rank}
        lasts = [last for rank_id, _, last in steps.step_bounds(conn, run) if rank_id in ids and last is not None]
    finally:
        conn.close()
    if not lasts:
        return StepPick(None, "no steps stored yet")
    if rank is not None:
        return StepPick(max(lasts), f"rank {rank}'s newest step")
    return StepPick(min(lasts), "the newest step every rank recorded")


def verdict_step(db_path: str, run: RunRef, rank: int) -> StepPick:
    """The step of ``rank``'s recent ones where its busy time was furthest above the other
    ranks' median: where a straggler verdict shows most. Busy time is the straggler rule's:
    the step less its measured wait, under FSDP2 less the wait inside its collectives."""
    conn = connect(db_path)
    try:
        busy: dict[int, dict[int, float]] = {}  # global rank -> step -> busy ns
        cols = steps.STEP_COLS
        at_step, at_ns, at_wait = cols.index("step"), cols.index("step_ns"), cols.index("wait_ns")
        ranks = [
            (row.rank_id, row.global_rank,
             [r for r in steps.rank_steps(conn, row.rank_id, VERDICT_WINDOW) if r[at_ns] is not None])
            for row in reader.load_ranks(conn, run) if row.global_rank is not None
        ]
        waits = fsdp2.collective_wait(conn, [(rank_id, sorted(r[at_step] for r in rows)) for rank_id, _, rows in ranks])
        for rank_id, global_rank, rows in ranks:
            comm = waits.get(rank_id)
            if comm is None:
                busy[global_rank] = {r[at_step]: r[at_ns] - (r[at_wait] or 0) for r in rows}
            else:
                busy[global_rank] = {
                    r[at_step]: r[at_ns] - sum(v or 0 for v in comm.get(r[at_step], ())) for r in rows
                }
    finally:
        conn.close()
    own = busy.get(rank) or {}
    best: tuple[float, int] | None = None
    for step, value in own.items():
        others = [b[step] for g, b in busy.items() if g != rank and step in b]
        if others:
            excess = value - statistics.median(others)
            if best is None or excess > best[0]:
                best = (excess, step)
    if best is None:
        return default_step(db_path, run, rank)
    return StepPick(best[1], f"rank {rank}'s worst of its newest {VERDICT_WINDOW} steps "
                             f"(+{best[0] / 1e6:.1f} ms busy over the others' median)")


def read_step(db_path: str, run: RunRef, step: int, rank: int | None = None) -> StepView:
    """The step inspector's view. Raises StepNotFound, RankNotFound."""
    conn = connect(db_path)
    try:
        return load_step(conn, run, step, rank)
    finally:
        conn.close()


def read_logs(db_path: str, run: RunRef) -> tuple[int, list[Folded]]:
    """(lines read, folded entries) of every rank's newest lines, an equal share each."""
    conn = connect(db_path)
    try:
        if not output.has_output(conn):
            return 0, []
        rows = reader.load_ranks(conn, run)
        share = max(MIN_LOG_LINES_PER_RANK, LOG_LINES // max(1, len(rows)))
        lines: list[OutputLine] = []
        for row in rows:
            rank = int(row.global_rank if row.global_rank is not None else -row.rank_id)
            lines += [OutputLine(rank, *r) for r in output.rank_output(conn, row.rank_id, share)]
    finally:
        conn.close()
    return len(lines), fold(lines)
