"""`traceml-daemon inspect --db PATH --step S [--rank R] [--session ID] [--json]`: one step, every rank.

Phase times, the measured all-reduce, memory, the scalars logged at the step,
the spans and output lines inside it, layer timings where it was sampled, each
rank's status and the process, host and GPU samples nearest its end, and which
ranks were outside the band (the straggler rule on this one step) and by how
much. The reads are ``store.read.step_detail``'s; the TUI's step inspector
shows ``render_text`` of the same view.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from traceml_daemon.commands import json_out
from traceml_daemon.store import reader
from traceml_daemon.store.read.step_detail import RankNotFound, RankStep, StepNotFound, StepView, load_step
from traceml_daemon.store.reader import RankRow
from traceml_wire.printable import printable, printable_text
from traceml_wire.tables import PHASES

DEFAULT_DB = "traceml.db"
_MS = 1e6
_MIB = 2**20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", default=DEFAULT_DB, help=f"database (default ./{DEFAULT_DB})")
    parser.add_argument("--step", type=int, required=True, help="the step to show")
    parser.add_argument("--rank", type=int, default=None, help="details of this global rank only (the band is of all)")
    parser.add_argument("--session", default=None, help="this session (default: the latest run; `runs` lists them)")
    parser.add_argument("--json", action="store_true", help="print JSON on stdout")


# ---------------------------------------------------------------- JSON


def _ms(ns: int | None) -> float | None:
    return None if ns is None else round(ns / _MS, 3)


def _row_json(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "ts": row["ts"],
        "step_ms": _ms(row["step_ns"]),
        "phases_ms": {p: _ms(row[f"{p}_ns"]) for p in PHASES},
        "comm_ms": _ms(row["comm_ns"]),
        "memory": {"peak_bytes": row["peak_bytes"], "reserved_bytes": row["reserved_bytes"],
                   "rss_bytes": row["rss_bytes"]},
    }


def _rank_json(row: RankRow, rs: RankStep) -> dict[str, Any]:
    status = rs.status
    return {
        "global_rank": row.global_rank,
        "local_rank": row.local_rank,
        "node_rank": row.node_rank,
        "hostname": row.hostname,
        "recorded": rs.recorded,
        "models": [_row_json(r) for r in rs.rows],
        "scalars": rs.scalars,
        "spans": rs.spans,
        "layers": rs.layers,
        "status": None if status is None else {
            "ts": status.ts, "phase": status.phase, "phase_since": status.phase_since, "step": status.step,
            "steps_done": status.steps_done, "finished": status.finished,
        },
        "process": rs.process,
        "host": rs.host,
        "gpus": rs.gpus,
        "output": rs.output,
    }


def view_json(view: StepView) -> dict[str, Any]:
    return {
        "session": view.run.session,
        "attempt": view.run.attempt,
        "step": view.step,
        "parallelism": view.parallelism,
        "first_step": view.first_step,
        "last_step": view.last_step,
        "ranks_recorded": sum(1 for _, rs in view.ranks if rs.recorded),
        "ranks": [_rank_json(row, rs) for row, rs in view.ranks],
        "out_of_band": [o.to_json() for o in view.out_of_band],
        "profiles": [{"rank": p.rank, "step": p.step, "steps": p.steps, "path": p.path} for p in view.profiles],
    }


# ---------------------------------------------------------------- text


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / _MIB:.0f}M"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("-" * len(lines[0]))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return lines


def _band_lines(view: StepView) -> list[str]:
    if not view.out_of_band:
        return ["Out of band: none (every rank within the straggler band at this step)"]
    lines = ["Out of band (busy time = step minus measured wait, under FSDP2 minus the collectives' wait; "
             "against the others' median):"]
    for o in view.out_of_band:
        where = f"rank {o.global_rank}" + (f" (node {o.node_rank})" if o.node_rank is not None else "")
        what = (f", {o.phase} +{o.phase_excess_ms:.1f} ms" if o.phase is not None and o.phase_excess_ms is not None
                else ", in no measured phase")
        lines.append(f"  {where}: +{o.excess_ms:.1f} ms busy ({o.busy_ms:.1f} vs {o.others_busy_ms:.1f} ms)"
                     f"{what} -> {o.name}")
    return lines


def _detail_lines(row: RankRow, rs: RankStep) -> list[str]:
    head = f"Rank {row.global_rank} (node {row.node_rank}, local {row.local_rank}, host {row.hostname})"
    if not rs.recorded:
        return [head + ": did not record this step"]
    lines = [head]
    end = max(r["ts"] for r in rs.rows if r["ts"] is not None) if any(r["ts"] for r in rs.rows) else None
    if rs.status is not None:
        s = rs.status
        lines.append(f"  status now: {s.phase}, step {s.step}, {s.steps_done} steps done"
                     + (", finished" if s.finished else ""))
    if rs.scalars:
        lines.append("  scalars: " + ", ".join(f"{k}={v:.6g}" if v is not None else f"{k}=-"
                                               for k, v in rs.scalars.items()))
    for span in rs.spans:
        at = "" if end is None else f" at {(span['start_ns'] / 1e9 - end) * 1e3:+.1f} ms from step end"
        dur = "instant" if span["dur_ns"] is None else f"{span['dur_ns'] / _MS:.2f} ms"
        lines.append(f"  span {span['name']}: {dur}{at}")
    if rs.layers:
        lines.append(f"  layers ({len(rs.layers)} sampled at this step; forward/backward ms, activations):")
        lines += [f"    {lay['layer']}: {_f(_ms(lay['forward_ns']))} / {_f(_ms(lay['backward_ns']))}, "
                  f"{_mib(lay['activation_bytes'])}" for lay in rs.layers]
    if rs.process is not None:
        p = rs.process
        lines.append(f"  process ({_offset(p['ts'], end)}): cpu {_f(p['cpu_pct'], 0)}%, rss {_mib(p['rss_bytes'])}, "
                     f"gpu mem {_mib(p['gpu_mem_bytes'])}, threads {p['threads'] if p['threads'] is not None else '-'}")
    if rs.host is not None:
        h = rs.host
        lines.append(f"  host ({_offset(h['ts'], end)}): cpu {_f(h['cpu_pct'], 0)}%, mem {_mib(h['mem_used_bytes'])} of "
                     f"{_mib(h['mem_total_bytes'])}")
    for g in rs.gpus:
        lines.append(f"  gpu {g['gpu_index']} ({_offset(g['ts'], end)}): util {_f(g['util_pct'], 0)}%, mem "
                     f"{_mib(g['mem_used_bytes'])} of {_mib(g['mem_total_bytes'])}, {_f(g['temp_c'], 0)} C, "
                     f"{_f(g['power_w'], 0)} W")
    if rs.output:
        lines.append(f"  output during the step ({len(rs.output)} lines):")
        lines += [f"    [{o['stream']}] {printable(o['line'], 400)}" for o in rs.output]
    return lines


def _offset(ts: float | None, end: float | None) -> str:
    if ts is None or end is None:
        return "sample"
    return f"sample {ts - end:+.1f} s from step end"


def _profile_lines(view: StepView) -> list[str]:
    """The torch.profiler traces that cover this step (`traceml-daemon profile`, profile_steps)."""
    return [
        f"torch.profiler trace: rank {p.rank} steps {p.step}-{(p.step or 0) + (p.steps or 1) - 1}: {p.path}"
        for p in view.profiles
    ]


def render_text(view: StepView, rank: int | None = None) -> str:
    recorded = sum(1 for _, rs in view.ranks if rs.recorded)
    stored = "" if view.first_step is None else f"; steps {view.first_step}-{view.last_step} stored"
    lines = [
        f"Step {view.step} of session {view.run.session} (attempt {view.run.attempt}), {view.parallelism}: "
        f"{recorded} of {len(view.ranks)} rank(s) recorded it{stored}",
        *_band_lines(view),
        *_profile_lines(view),
        "",
        "Phases (ms) and memory",
    ]
    headers = ["rank", "node", "step", *PHASES, "comm", "peak", "rss"]
    rows: list[list[str]] = []
    for row, rs in view.ranks:
        if not rs.recorded:
            rows.append([str(row.global_rank), str(row.node_rank), "(not recorded)", *[""] * (len(PHASES) + 3)])
            continue
        for r in rs.rows:
            rows.append([
                str(row.global_rank), str(row.node_rank), _f(_ms(r["step_ns"])),
                *(_f(_ms(r[f"{p}_ns"])) for p in PHASES), _f(_ms(r["comm_ns"])), _mib(r["peak_bytes"]),
                _mib(r["rss_bytes"]),
            ])
    lines += _table(headers, rows)
    for row, rs in view.ranks:
        if rank is None or row.global_rank == rank:
            lines += ["", *_detail_lines(row, rs)]
    # Hostnames, span and layer names, output lines: peer text, no escape sequence gets through.
    return printable_text("\n".join(lines)) + "\n"


# ---------------------------------------------------------------- command


def inspect_step(db_path: str, step: int, rank: int | None = None, session: str | None = None) -> StepView:
    """The view of ``step``. Raises StoreError, UnknownSession, StepNotFound, RankNotFound."""
    conn = reader.open_readonly(db_path)
    try:
        run = reader.resolve_run(conn, session)
        if run is None:
            raise StepNotFound(f"{db_path} holds no run yet")
        return load_step(conn, run, step, rank)
    finally:
        conn.close()


def main(args: argparse.Namespace | list[str] | None = None) -> int:
    if not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(prog="traceml-daemon inspect", description="Everything every rank recorded at one step.")
        add_arguments(parser)
        args = parser.parse_args(args)
    try:
        view = inspect_step(args.db, args.step, args.rank, args.session)
    except (reader.StoreError, StepNotFound, RankNotFound) as exc:
        print(f"traceml-daemon inspect: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    except reader.UnknownSession as exc:
        print(f"traceml-daemon inspect: {args.db}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        # With --rank, every rank's phases are there (the band is of all); the rest is that rank's.
        json_out.dump(view_json(view), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_text(view, args.rank))
    return 0


if __name__ == "__main__":
    sys.exit(main())
