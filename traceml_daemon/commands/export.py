"""``traceml-daemon export``: a stored run as a Chrome trace (Perfetto) or CSV.

The database is opened read-only (``file:PATH?mode=ro``), so exporting a live
run never blocks the daemon's writer; every read is the read layer's
(``store.read``). Chrome traces are written one rank at a time: only one rank's
events are held in memory, so a long run exports in bounded memory (use
``--steps`` to keep the file small enough for a viewer).

A Chrome trace is strict JSON whatever the database holds: a stored infinity
(or a NaN in a span's args) is written as null, and a step, phase or span with
a negative duration is left out of the ``X`` events and flagged (a step or span
becomes an instant event, a phase is listed in its step's args; the stored
values stay in args). Both are counted in the trace's ``metadata`` and on stderr.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import math
import sqlite3
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from traceml_daemon import __version__
from traceml_daemon.commands import export_lanes, json_out
from traceml_daemon.store.read import spans as stored_spans
from traceml_daemon.store.read import steps as stored_steps
from traceml_daemon.store.read.connect import connect_file, table_names
from traceml_daemon.store.read.rollouts import has_sessions, rank_sessions
from traceml_daemon.store.read.runs import UnknownSession, resolve_run
from traceml_daemon.store.reader import all_ranks
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

    @property
    def bounded(self) -> bool:
        return self.first is not None or self.last is not None


@dataclass
class TraceCounts:
    """What a Chrome export wrote, and what it could not draw as stored."""

    events: int = 0
    non_finite: int = 0  # stored infinities (and NaNs in span args), written as null
    negative_durations: int = 0  # steps, phases and spans left out of the X events

    def note(self) -> str:
        """The stderr line's addendum, empty when nothing was out of the ordinary."""
        parts = []
        if self.non_finite:
            parts.append(f"{self.non_finite} non-finite values written as null")
        if self.negative_durations:
            parts.append(f"{self.negative_durations} negative durations left out")
        return f" ({', '.join(parts)})" if parts else ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", required=True, help="database written by traceml-daemon serve")
    parser.add_argument("--format", required=True, help="chrome (Trace Event JSON for Perfetto / chrome://tracing) or csv")
    parser.add_argument("out", help="output file; a name ending in .gz is written gzip-compressed")
    parser.add_argument("--steps", default=None, metavar="A:B",
                        help="only steps A..B, both inclusive (A: or :B leave one end open)")
    runs = parser.add_mutually_exclusive_group()
    runs.add_argument("--session", default=None,
                      help="this session, every attempt of it (default: the latest run; `traceml-daemon runs` lists them)")
    runs.add_argument("--all-sessions", action="store_true", help="every session in the database, a lane set each")


def main(args: argparse.Namespace) -> int:
    try:
        fmt = str(args.format).lower()
        if fmt not in FORMATS:
            raise ExportError(f"unknown format {args.format!r} (expected one of: {', '.join(FORMATS)})")
        steps = parse_steps(args.steps)
        with open_db(Path(args.db)) as con:
            ranks = load_ranks(con, args.session, every=getattr(args, "all_sessions", False))
            out = Path(args.out)
            note = ""
            if fmt == "chrome":
                counts = write_chrome(con, ranks, steps, out, db_path=Path(args.db))
                n, note = counts.events, counts.note()
            else:
                n = write_csv(con, ranks, steps, out)
    except ExportError as exc:
        print(f"traceml-daemon export: {exc}", file=sys.stderr)
        return 2
    kind = "events" if fmt == "chrome" else "rows"
    print(f"wrote {n} {kind} from {len(ranks)} ranks to {out}{note}", file=sys.stderr)
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
    try:
        con = connect_file(path)
    except sqlite3.Error as exc:
        raise ExportError(f"cannot open {path}: {exc}") from None
    try:
        try:
            tables = table_names(con)
        except sqlite3.DatabaseError as exc:
            raise ExportError(f"{path} is not a traceml database ({exc})") from None
        missing = {"ranks", "steps", "spans"} - tables
        if missing:
            raise ExportError(f"{path} is not a traceml database (no {', '.join(sorted(missing))} table)")
        yield con
    finally:
        con.close()


def load_ranks(con: sqlite3.Connection, session: str | None, every: bool = False) -> list[Rank]:
    """The ranks exported: every attempt of ``session``, else of the latest run, or (``every``)
    all of the database's; ExportError naming the sessions there when ``session`` is not."""
    if not every:
        try:
            run = resolve_run(con, session)
        except UnknownSession as exc:
            raise ExportError(str(exc)) from None
        if run is None:
            return []
        session = run.session
    ranks = [
        Rank(r.rank_id, str(r.session), int(r.attempt or 0), r.global_rank, r.local_rank, r.node_rank, r.hostname)
        for r in all_ranks(con, None if every else session)
    ]
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


# Where each value sits in a row of ``store.read.steps.STEP_COLS``.
_AT = {name: i for i, name in enumerate(stored_steps.STEP_COLS)}
_PHASES_AT = [_AT[f"{p}_ns"] for p in PHASES]


def write_csv(con: sqlite3.Connection, ranks: list[Rank], steps: StepRange, out: Path) -> int:
    n = 0
    with open_out(out) as fh:
        writer = csv.writer(fh)
        writer.writerow(CSV_COLUMNS)
        for rank in ranks:
            for row in stored_steps.steps_in_range(con, rank.rank_id, steps.first, steps.last):
                step, ts, step_ns = row[0], row[1], row[2]
                phases = [row[i] for i in _PHASES_AT]
                peak, rss = row[_AT["peak_bytes"]], row[_AT["rss_bytes"]]
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
    span_ns = stored_spans.earliest_span_start_ns(con, ids)
    candidates = [stored_steps.earliest_step_start(con, ids), None if span_ns is None else span_ns / 1e9]
    finite = [v for v in candidates if v is not None and math.isfinite(v)]
    return float(int(min(finite))) if finite else 0.0


def _finite_row(row: Sequence[Any], counts: TraceCounts) -> list[Any]:
    """``row`` with each non-finite number (a stored infinity) as None, counted: not a measurement."""
    out = list(row)
    for i, v in enumerate(out):
        if isinstance(v, float) and not math.isfinite(v):
            out[i] = None
            counts.non_finite += 1
    return out


def _strict(value: Any, counts: TraceCounts) -> Any:
    """``value`` (an event or part of one) with non-finite floats as None, counted."""

    def null(_: float) -> None:
        counts.non_finite += 1

    return json_out.strict(value, null)


def step_events(rank: Rank, steps: StepRange, con: sqlite3.Connection, base: float,
                counts: TraceCounts | None = None) -> list[dict[str, Any]]:
    """Step, phase and memory counter events of one rank (``counts``: what was not drawn as stored)."""
    counts = counts if counts is not None else TraceCounts()
    pid = rank.rank_id
    events: list[dict[str, Any]] = []
    prev_end: float | None = None
    for stored in stored_steps.steps_in_range(con, rank.rank_id, steps.first, steps.last, by_time=True):
        row = _finite_row(stored, counts)
        step, ts, step_ns = row[0], row[1], row[2]
        phases = {p: row[i] for p, i in zip(PHASES, _PHASES_AT, strict=True)}
        comm_ns, peak, rss = row[_AT["comm_ns"]], row[_AT["peak_bytes"]], row[_AT["rss_bytes"]]
        if ts is None:
            continue
        end = (ts - base) * 1e6
        # A negative duration is never drawn: that slice is left out of the X events and
        # flagged in the step's args, where its stored value stays.
        drawn = [(p, ns / 1e3) for p, ns in phases.items() if ns is not None and ns >= 0]
        negative = [p for p, ns in phases.items() if ns is not None and ns < 0]
        draw_step = step_ns is None or step_ns >= 0
        if not draw_step:
            negative.insert(0, "step")
        counts.negative_durations += len(negative)
        total_us = max(step_ns / 1e3 if step_ns is not None and draw_step else 0.0, sum(d for _, d in drawn))
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
        if negative:
            args["negative_durations"] = negative
        event: dict[str, Any] = {"name": f"step {step}", "cat": "step", "pid": pid, "tid": TID_STEPS, "args": args}
        if draw_step:
            event.update(ph="X", ts=start, dur=end - start)
        else:  # an instant at the step's end: its args stay in the trace
            event.update(ph="i", s="t", ts=end)
        events.append(event)
        # Phases back to back, ending at the step's end, in execution order.
        t = end - sum(d for _, d in drawn)
        for phase, dur in drawn:
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
                window: tuple[float, float] | None, counts: TraceCounts | None = None) -> list[dict[str, Any]]:
    """User spans (complete events) and instants of one rank.

    With a step range, spans tagged with a step are filtered by it; untagged
    ones are kept when they start inside the selected steps' time window.
    """
    counts = counts if counts is not None else TraceCounts()
    pid = rank.rank_id
    events: list[dict[str, Any]] = []
    for stored in stored_spans.rank_spans(con, rank.rank_id):
        name, start_ns, dur_ns, step, raw_args, category, lane = _finite_row(stored, counts)
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
        event: dict[str, Any] = {"name": name or "span", "cat": category or "span", "pid": pid, "tid": TID_SPANS,
                                 "ts": ts, "args": args, "lane": lane}
        if dur_ns is not None and dur_ns < 0:  # never drawn: an instant flagged with the stored duration
            counts.negative_durations += 1
            args["negative_duration_ms"] = dur_ns / 1e6
            event.update(ph="i", s="t")
        elif dur_ns is None:
            event.update(ph="i", s="t")
        else:
            event.update(ph="X", dur=dur_ns / 1e3)
        events.append(event)
    return events


def _place_spans(spans: list[dict[str, Any]]) -> dict[int, str]:
    """Give each span the row of its lane (threads a row each, asyncio tasks packed into
    few rows); returns the rows' names. Spans stored without a lane stay on TID_SPANS."""
    bounds: dict[str | None, tuple[float, float]] = {}
    for e in spans:
        lane = e.get("lane")
        end = e["ts"] + e.get("dur", 0.0)
        have = bounds.get(lane)
        bounds[lane] = (e["ts"], end) if have is None else (min(have[0], e["ts"]), max(have[1], end))
    tids, names = export_lanes.span_rows({k: v for k, v in bounds.items() if k is not None})
    for e in spans:
        lane = e.pop("lane", None)
        if lane is not None:
            e["tid"] = tids[lane]
    return names


def _end_of_data(events: list[dict[str, Any]], base: float) -> float:
    """Wall seconds of the last event drawn (closes sessions still pending)."""
    ends = [e["ts"] + e.get("dur", 0.0) for e in events if "ts" in e]
    return base + (max(ends) / 1e6 if ends else 0.0)


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


def write_chrome(con: sqlite3.Connection, ranks: list[Rank], steps: StepRange, out: Path,
                 db_path: Path) -> TraceCounts:
    counts = TraceCounts()
    base = _base_ts(con, ranks)
    many_runs = len({(r.session, r.attempt) for r in ranks}) > 1
    with_sessions = has_sessions(con)
    node_order = sorted({(r.node_rank is None, r.node_rank or 0) for r in ranks})
    metadata = {
        "tool": "traceml-daemon", "version": __version__, "db": str(db_path),
        "sessions": sorted({r.session for r in ranks}), "base_epoch_s": base,
        "steps": None if not steps.bounded else [steps.first, steps.last],
        "ts_unit": "microseconds since base_epoch_s",
    }
    with open_out(out) as fh:
        fh.write('{"displayTimeUnit": "ms", "traceEvents": [\n')
        first = True

        def emit(event: dict[str, Any]) -> None:
            nonlocal first
            try:
                text = json.dumps(event, separators=(",", ":"), allow_nan=False)
            except ValueError:  # a non-finite float, e.g. a NaN in a span's args
                text = json.dumps(_strict(event, counts), separators=(",", ":"), allow_nan=False)
            fh.write(("" if first else ",\n") + text)
            first = False
            counts.events += 1

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
            lane = step_events(rank, steps, con, base, counts)
            window = None
            slices = [e for e in lane if e["ph"] == "X"]
            if slices:
                window = (min(e["ts"] for e in slices), max(e["ts"] + e["dur"] for e in slices))
            spans = span_events(rank, steps, con, base, window, counts)
            for tid, row_name in _place_spans(spans).items():
                emit({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": row_name}})
            lane += spans
            stored = rank_sessions(con, rank.rank_id, rank.global_rank) if with_sessions else []
            sessions, session_rows = export_lanes.session_events(stored, pid, base, _end_of_data(lane, base),
                                                                 window if steps.bounded else None)
            for tid, row_name in session_rows.items():
                emit({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": row_name}})
            lane += sessions
            for event in sorted(lane, key=_lane_order):
                emit(event)
        metadata["non_finite_values"] = counts.non_finite
        metadata["negative_durations"] = counts.negative_durations
        metadata["data_notes"] = (
            "non_finite_values: stored infinities or NaNs, written as null (a step or span that needed one as its "
            "time is left out); negative_durations: steps, phases and spans with a negative duration, left out of "
            "the X events and flagged: a step or span becomes an instant event, a phase is listed in its step's "
            "args under negative_durations, the stored values staying in args"
        )
        fh.write('\n], "metadata": ')
        fh.write(json.dumps(_strict(metadata, counts), allow_nan=False))
        fh.write("}\n")
    return counts
