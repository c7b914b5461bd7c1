"""``traceml-daemon export``: a stored run as a Chrome trace (Perfetto) or CSV.

The database is opened read-only (``file:PATH?mode=ro``), so exporting a live
run never blocks the daemon's writer. Chrome traces are written one rank at a
time: only one rank's events are held in memory, so a long run exports in
bounded memory (use ``--steps`` to keep the file small enough for a viewer).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import sqlite3
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from traceml_daemon import __version__
from traceml_daemon.store.schema import rank_is, ranks_in
from traceml_wire.tables import PHASES

FORMATS = ("chrome", "csv")
# Track ids inside a rank's process lane: steps/phases/counters on one thread,
# user spans on another, because spans may straddle step boundaries and a
# trace viewer requires the slices of one thread to nest strictly.
TID_STEPS = 1
TID_SPANS = 2
CSV_COLUMNS = (
    "session", "attempt", "node_rank", "global_rank", "local_rank", "step", "ts", "step_ms",
    *(f"{p}_ms" for p in PHASES), "peak_bytes", "rss_bytes",
)


class ExportError(Exception):
    """A user-facing failure: printed as one line, exit code 2."""


@dataclass(frozen=True)
class Rank:
    rank_id: int
    session: str
    attempt: int
    global_rank: int | None
    local_rank: int | None
    node_rank: int | None
    hostname: str | None

    def sort_key(self) -> tuple[Any, ...]:
        # None sorts last: a rank whose identity is incomplete still gets a lane.
        def k(v: int | None) -> tuple[int, int]:
            return (1, 0) if v is None else (0, v)

        return (self.session, self.attempt, k(self.node_rank), k(self.global_rank), self.rank_id)


@dataclass(frozen=True)
class StepRange:
    first: int | None
    last: int | None  # inclusive

    def sql(self) -> tuple[str, tuple[int, ...]]:
        clauses, params = [], []
        if self.first is not None:
            clauses.append("step >= ?")
            params.append(self.first)
        if self.last is not None:
            clauses.append("step <= ?")
            params.append(self.last)
        return "".join(f" AND {c}" for c in clauses), tuple(params)

    @property
    def bounded(self) -> bool:
        return self.first is not None or self.last is not None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", required=True, help="database written by traceml-daemon serve")
    parser.add_argument("--format", required=True, help="chrome (Trace Event JSON for Perfetto / chrome://tracing) or csv")
    parser.add_argument("out", help="output file; a name ending in .gz is written gzip-compressed")
    parser.add_argument("--steps", default=None, metavar="A:B",
                        help="only steps A..B, both inclusive (A: or :B leave one end open)")
    parser.add_argument("--session", default=None, help="only this session (default: every session in the database)")


def main(args: argparse.Namespace) -> int:
    try:
        fmt = str(args.format).lower()
        if fmt not in FORMATS:
            raise ExportError(f"unknown format {args.format!r} (expected one of: {', '.join(FORMATS)})")
        steps = parse_steps(args.steps)
        with open_db(Path(args.db)) as con:
            ranks = load_ranks(con, args.session)
            out = Path(args.out)
            if fmt == "chrome":
                n = write_chrome(con, ranks, steps, out, db_path=Path(args.db))
            else:
                n = write_csv(con, ranks, steps, out)
    except ExportError as exc:
        print(f"traceml-daemon export: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {n} {'events' if fmt == 'chrome' else 'rows'} from {len(ranks)} ranks to {out}", file=sys.stderr)
    return 0


def parse_steps(text: str | None) -> StepRange:
    if not text:
        return StepRange(None, None)
    first, sep, last = text.partition(":")
    try:
        if not sep:
            one = int(first)
            return StepRange(one, one)
        rng = StepRange(int(first) if first.strip() else None, int(last) if last.strip() else None)
    except ValueError:
        raise ExportError(f"--steps {text!r} is not A:B with integer A and B") from None
    if rng.first is not None and rng.last is not None and rng.first > rng.last:
        raise ExportError(f"--steps {text!r}: the first step is after the last")
    return rng


@contextmanager
def open_db(path: Path) -> Iterator[sqlite3.Connection]:
    if not path.is_file():
        raise ExportError(f"no database at {path}")
    # as_uri() percent-encodes the path, so names with '?' or '#' stay intact.
    uri = path.resolve().as_uri() + "?mode=ro"
    try:
        con = sqlite3.connect(uri, uri=True)
    except sqlite3.Error as exc:
        raise ExportError(f"cannot open {path}: {exc}") from None
    try:
        try:
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        except sqlite3.DatabaseError as exc:
            raise ExportError(f"{path} is not a traceml database ({exc})") from None
        missing = {"ranks", "steps", "spans"} - tables
        if missing:
            raise ExportError(f"{path} is not a traceml database (no {', '.join(sorted(missing))} table)")
        yield con
    finally:
        con.close()


def load_ranks(con: sqlite3.Connection, session: str | None) -> list[Rank]:
    sql = "SELECT rank_id, session, attempt, global_rank, local_rank, node_rank, hostname FROM ranks"
    params: tuple[str, ...] = ()
    if session is not None:
        sql += " WHERE session = ?"
        params = (session,)
    ranks = [Rank(int(r[0]), str(r[1]), int(r[2] or 0), r[3], r[4], r[5], r[6]) for r in con.execute(sql, params)]
    if session is not None and not ranks:
        known = [r[0] for r in con.execute("SELECT DISTINCT session FROM ranks ORDER BY session")]
        raise ExportError(f"no session {session!r} in the database (sessions: {', '.join(known) or 'none'})")
    return sorted(ranks, key=Rank.sort_key)


@contextmanager
def open_out(path: Path) -> Iterator[IO[str]]:
    try:
        if path.suffix == ".gz":
            fh: IO[str] = gzip.open(path, "wt", encoding="utf-8", newline="")
        else:
            fh = open(path, "w", encoding="utf-8", newline="")
    except OSError as exc:
        raise ExportError(f"cannot write {path}: {exc.strerror or exc}") from None
    with fh:
        yield fh


def _ms(ns: int | None) -> float | None:
    return None if ns is None else ns / 1e6


# ---------------------------------------------------------------- CSV


def write_csv(con: sqlite3.Connection, ranks: list[Rank], steps: StepRange, out: Path) -> int:
    where, params = steps.sql()
    cols = ", ".join(["step", "ts", "step_ns", *(f"{p}_ns" for p in PHASES), "peak_bytes", "rss_bytes"])
    n = 0
    with open_out(out) as fh:
        writer = csv.writer(fh)
        writer.writerow(CSV_COLUMNS)
        for rank in ranks:
            cur = con.execute(f"SELECT {cols} FROM steps WHERE {rank_is('?1')}{where} ORDER BY step, ts",
                              (rank.rank_id, *params))
            for row in cur:
                step, ts, step_ns, *rest = row
                phases, (peak, rss) = rest[: len(PHASES)], rest[len(PHASES):]
                writer.writerow([rank.session, rank.attempt, rank.node_rank, rank.global_rank, rank.local_rank,
                                 step, ts, _ms(step_ns), *(_ms(p) for p in phases), peak, rss])
                n += 1
    return n


# ---------------------------------------------------------------- Chrome trace


def _lane_name(rank: Rank, many_runs: bool) -> str:
    name = f"node {_q(rank.node_rank)} / rank {_q(rank.global_rank)} (local {_q(rank.local_rank)}) {rank.hostname or '?'}"
    if many_runs:  # restarts or several sessions: tell the lanes apart
        name += f" [{rank.session} attempt {rank.attempt}]"
    return name


def _q(value: int | None) -> str:
    return "?" if value is None else str(value)


def _base_ts(con: sqlite3.Connection, ranks: list[Rank]) -> float:
    """Earliest time in the export, whole seconds: trace timestamps are relative
    to it so they stay small and keep sub-microsecond precision in a double."""
    ids = [r.rank_id for r in ranks]
    if not ids:
        return 0.0
    these = ranks_in(len(ids))
    row = con.execute(
        f"SELECT MIN(ts - COALESCE(step_ns, 0) / 1e9 - COALESCE(dataloader_ns, 0) / 1e9) FROM steps WHERE {these}",
        ids).fetchone()
    span = con.execute(f"SELECT MIN(start_ns) FROM spans WHERE {these}", ids).fetchone()
    candidates = [v for v in (row[0], None if span[0] is None else span[0] / 1e9) if v is not None]
    return float(int(min(candidates))) if candidates else 0.0


def step_events(rank: Rank, steps: StepRange, con: sqlite3.Connection, base: float) -> list[dict[str, Any]]:
    """Step, phase and memory counter events of one rank."""
    pid = rank.rank_id
    where, params = steps.sql()
    cols = ", ".join(["step", "ts", "step_ns", *(f"{p}_ns" for p in PHASES), "comm_ns", "peak_bytes", "rss_bytes"])
    events: list[dict[str, Any]] = []
    prev_end: float | None = None
    for row in con.execute(f"SELECT {cols} FROM steps WHERE {rank_is('?1')}{where} ORDER BY ts, step",
                           (rank.rank_id, *params)):
        step, ts, step_ns, *rest = row
        phases = dict(zip(PHASES, rest[: len(PHASES)], strict=True))
        comm_ns, peak, rss = rest[len(PHASES):]
        if ts is None:
            continue
        end = (ts - base) * 1e6
        phase_us = [(p, ns / 1e3) for p, ns in phases.items() if ns is not None]
        total_us = max(step_ns / 1e3 if step_ns is not None else 0.0, sum(d for _, d in phase_us))
        start = end - total_us
        # Clock jitter (wall clock at the end, monotonic durations) can make a
        # step start a hair before the previous one ended; clamp so slices on
        # the lane nest strictly. The true durations stay in args.
        if prev_end is not None and start < prev_end:
            start = min(prev_end, end)
        prev_end = end
        args: dict[str, Any] = {"step": step, "step_ms": _ms(step_ns)}
        args.update({f"{p}_ms": _ms(ns) for p, ns in phases.items() if ns is not None})
        if comm_ns is not None:
            args["comm_ms"] = _ms(comm_ns)
        events.append({"name": f"step {step}", "cat": "step", "ph": "X", "pid": pid, "tid": TID_STEPS,
                       "ts": start, "dur": end - start, "args": args})
        # Phases back to back, ending at the step's end, in execution order.
        t = end - sum(d for _, d in phase_us)
        for phase, dur in phase_us:
            p_start, p_end = max(t, start), max(t + dur, start)
            t += dur
            events.append({"name": phase, "cat": "phase", "ph": "X", "pid": pid, "tid": TID_STEPS,
                           "ts": p_start, "dur": p_end - p_start, "args": {"step": step, "ms": dur / 1e3}})
        memory = {k: v for k, v in (("rss_bytes", rss), ("peak_bytes", peak)) if v is not None}
        if memory:
            events.append({"name": "memory", "cat": "memory", "ph": "C", "pid": pid, "tid": TID_STEPS,
                           "ts": end, "args": memory})
    return events


def span_events(rank: Rank, steps: StepRange, con: sqlite3.Connection, base: float,
                window: tuple[float, float] | None) -> list[dict[str, Any]]:
    """User spans (complete events) and instants of one rank.

    With a step range, spans tagged with a step are filtered by it; untagged
    ones are kept when they start inside the selected steps' time window.
    """
    pid = rank.rank_id
    events: list[dict[str, Any]] = []
    for name, start_ns, dur_ns, step, raw_args in con.execute(
            f"SELECT name, start_ns, dur_ns, step, args FROM spans WHERE {rank_is('?1')} ORDER BY start_ns",
            (rank.rank_id,)):
        if start_ns is None:
            continue
        ts = start_ns / 1e3 - base * 1e6
        if steps.bounded:
            if step is not None:
                if (steps.first is not None and step < steps.first) or (steps.last is not None and step > steps.last):
                    continue
            elif window is None or not (window[0] <= ts <= window[1]):
                continue
        args = _span_args(raw_args)
        if step is not None:
            args.setdefault("step", step)
        event: dict[str, Any] = {"name": name or "span", "cat": "span", "pid": pid, "tid": TID_SPANS,
                                 "ts": ts, "args": args}
        if dur_ns is None:
            event.update(ph="i", s="t")
        else:
            event.update(ph="X", dur=dur_ns / 1e3)
        events.append(event)
    return events


def _span_args(raw: str | None) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        return {"args": raw}
    return value if isinstance(value, dict) else {"args": value}


def _lane_order(event: dict[str, Any]) -> tuple[Any, ...]:
    # By time; at equal start the longer (enclosing) slice first so viewers nest it.
    return (event["ts"], -event.get("dur", 0.0), event["tid"])


def write_chrome(con: sqlite3.Connection, ranks: list[Rank], steps: StepRange, out: Path, db_path: Path) -> int:
    base = _base_ts(con, ranks)
    many_runs = len({(r.session, r.attempt) for r in ranks}) > 1
    node_order = sorted({(r.node_rank is None, r.node_rank or 0) for r in ranks})
    metadata = {
        "tool": "traceml-daemon", "version": __version__, "db": str(db_path),
        "sessions": sorted({r.session for r in ranks}), "base_epoch_s": base,
        "steps": None if not steps.bounded else [steps.first, steps.last],
        "ts_unit": "microseconds since base_epoch_s",
    }
    n = 0
    with open_out(out) as fh:
        fh.write('{"displayTimeUnit": "ms", "traceEvents": [\n')
        first = True

        def emit(event: dict[str, Any]) -> None:
            nonlocal first, n
            fh.write(("" if first else ",\n") + json.dumps(event, separators=(",", ":")))
            first = False
            n += 1

        for index, rank in enumerate(ranks):
            pid = rank.rank_id
            node_index = node_order.index((rank.node_rank is None, rank.node_rank or 0))
            emit({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                  "args": {"name": _lane_name(rank, many_runs)}})
            # Lanes grouped by node, then by rank (ranks is already in that order).
            emit({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                  "args": {"sort_index": index}})
            emit({"name": "process_labels", "ph": "M", "pid": pid, "tid": 0,
                  "args": {"labels": f"node {_q(rank.node_rank)} (#{node_index})"}})
            emit({"name": "thread_name", "ph": "M", "pid": pid, "tid": TID_STEPS, "args": {"name": "steps"}})
            emit({"name": "thread_name", "ph": "M", "pid": pid, "tid": TID_SPANS, "args": {"name": "spans"}})
            lane = step_events(rank, steps, con, base)
            window = None
            slices = [e for e in lane if e["ph"] == "X"]
            if slices:
                window = (min(e["ts"] for e in slices), max(e["ts"] + e["dur"] for e in slices))
            lane += span_events(rank, steps, con, base, window)
            for event in sorted(lane, key=_lane_order):
                emit(event)
        fh.write('\n], "metadata": ')
        fh.write(json.dumps(metadata))
        fh.write("}\n")
    return n
