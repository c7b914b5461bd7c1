"""`traceml-daemon sessions --db PATH [--session S] [--jsonl OUT | --json]`: rollout session records.

Every session of the run (``agent.session_context``), in AReaL's JSONL field
layout (task_id, session_id, rank, status, submit_ts, finalized_ts, total_s,
``<phase>_s``, phases) with ``--jsonl OUT`` (``-``: stdout), or the summary
and the records as one JSON document with ``--json``; by default a text
summary: sessions per second, status counts, p50/p95/p99 per phase,
acceptance per task, rejection reasons, the oldest sessions still pending and
the rollout verdicts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import IO, Any

from traceml_daemon.analysis import rollout_stats
from traceml_daemon.analysis.policy import Policy
from traceml_daemon.commands import json_out
from traceml_daemon.store import reader
from traceml_daemon.store.read.rollouts import SessionRecord, run_profiles, run_sessions, trainer_wait
from traceml_daemon.store.read.runs import RunRef, UnknownSession, resolve_run
from traceml_wire.printable import printable_text

DEFAULT_DB = "traceml.db"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", default=DEFAULT_DB, help=f"database (default ./{DEFAULT_DB})")
    parser.add_argument("--session", default=None, help="this session (default: the latest run; `runs` lists them)")
    parser.add_argument("--policy", metavar="FILE",
                        help="TOML file overriding thresholds, e.g. [rollouts] tail_ratio = 10 (docs/diagnosis.md)")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--jsonl", metavar="OUT", default=None,
                     help="write one JSON line per rollout session to OUT ('-': stdout)")
    out.add_argument("--json", action="store_true", help="print the summary and every session as JSON on stdout")


class Run:
    """The run's ranks and a way to stream its sessions (one rank in memory at a time)."""

    def __init__(self, conn: Any, run: RunRef | None, newest: int | None = None) -> None:
        self.conn = conn
        self.run = run
        self.newest = newest  # a live view reads each rank's newest sessions only
        ranks = reader.load_ranks(conn, run) if run is not None else []
        self.ranks = [(r.rank_id, r.global_rank) for r in ranks]

    def sessions(self) -> Iterator[SessionRecord]:
        return run_sessions(self.conn, self.ranks, self.newest)


def load_summary(run: Run, now: float, policy: Policy | None = None) -> dict[str, Any]:
    from traceml_daemon.analysis.rollouts import TrainerWait, rollout_verdicts

    stats = rollout_stats.collect(run.sessions())
    summary = rollout_stats.summarize(stats, now)
    summary["session"] = run.run.session if run.run is not None else None
    steps, step_s, waiting_s = trainer_wait(run.conn, run.ranks)
    trainer = TrainerWait(step_s=step_s, waiting_s=waiting_s, steps=steps)
    summary["trainer"] = {"steps": steps, "step_s": step_s, "waiting_for_rollouts_s": waiting_s}
    summary["verdicts"] = [v.to_json() for v in rollout_verdicts(stats, now, policy or Policy(), trainer)]
    summary["profiles"] = [p.__dict__ for p in run_profiles(run.conn, run.ranks)]
    return summary


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def render_text(summary: dict[str, Any]) -> str:
    lines = [f"Rollout sessions of session {summary['session']}"]
    if not summary["sessions"]:
        lines.append("(no rollout sessions stored: the job did not use agent.session_context)")
        return printable_text("\n".join(lines)) + "\n"
    rate = summary["sessions_per_s"]
    lines.append(f"sessions: {summary['sessions']} ({summary['finalized']} finalized, {summary['pending']} pending)"
                 + (f", {rate:.1f} finalized/s over {summary['window_s']:.1f} s" if rate else ""))
    lines.append("status:   " + ", ".join(f"{k} {v}" for k, v in summary["statuses"].items()))
    tasks = summary["tasks"]
    if tasks["tasks"]:
        lines.append(f"tasks:    {tasks['tasks']}, mean acceptance {tasks['acceptance_mean']:.0%}, "
                     f"{tasks['all_accepted']} all accepted, {tasks['none_accepted']} none accepted")
    lines.append("")
    lines.append(f"{'phase':<16}{'n':>8}{'p50 ms':>11}{'p95 ms':>11}{'p99 ms':>11}{'max ms':>11}{'share':>8}")
    for phase, d in summary["phases"].items():
        share = d.get("share_of_total_median")
        lines.append(f"{phase:<16}{d['n']:>8}{_ms(d['p50_s']):>11}{_ms(d['p95_s']):>11}{_ms(d['p99_s']):>11}"
                     f"{_ms(d['max_s']):>11}{'' if share is None else f'{share:.0%}':>8}")
    if summary["reasons"]:
        lines.append("")
        lines.append("reasons:  " + ", ".join(f"{k} ({v})" for k, v in summary["reasons"].items()))
    if summary["phases_left_open"]:
        lines.append(f"phases left open at finalization: {summary['phases_left_open']}")
    if summary["oldest_pending"]:
        lines.append("")
        lines.append("oldest pending:")
        for p in summary["oldest_pending"]:
            age = "-" if p["age_s"] is None else f"{p['age_s']:.1f} s"
            lines.append(f"  rank {p['rank']} task {p['task_id']} session {p['session_id']}: {age}"
                         f" (phases {', '.join(p['phases']) or 'none'})")
    if summary["verdicts"]:
        lines.append("")
        for v in summary["verdicts"]:
            lines.append(f"[{v['severity']}] {v['name']}: {v['why']}")
    if summary["profiles"]:
        lines.append("")
        lines.append("torch.profiler traces:")
        for p in summary["profiles"]:
            lines.append(f"  rank {p['rank']} step {p['step']} ({p['steps']} steps): {p['path']}")
    return printable_text("\n".join(lines)) + "\n"


def write_jsonl(run: Run, out: IO[str]) -> int:
    n = 0
    for rec in run.sessions():
        out.write(json.dumps(rollout_stats.areal_record(rec)))
        out.write("\n")
        n += 1
    return n


def main(args: argparse.Namespace | list[str] | None = None) -> int:
    if not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(prog="traceml-daemon sessions", description="Rollout session records.")
        add_arguments(parser)
        args = parser.parse_args(args)
    prog = "traceml-daemon sessions"
    policy = None
    if getattr(args, "policy", None):
        from traceml_daemon.analysis.policy_file import PolicyFileError, load_policy

        try:
            policy = load_policy(args.policy)
        except PolicyFileError as exc:
            print(f"{prog}: {exc}", file=sys.stderr)
            return 2
    try:
        conn = reader.open_readonly(args.db)
    except reader.StoreError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    try:
        try:
            run = Run(conn, resolve_run(conn, args.session))
        except UnknownSession as exc:
            print(f"{prog}: {exc}", file=sys.stderr)
            return 2
        if args.jsonl is not None:
            if args.jsonl == "-":
                write_jsonl(run, sys.stdout)
                return 0
            try:
                with open(args.jsonl, "w", encoding="utf-8") as fh:
                    n = write_jsonl(run, fh)
            except OSError as exc:
                print(f"{prog}: cannot write {args.jsonl}: {exc.strerror or exc}; pick a writable path",
                      file=sys.stderr)
                return 2
            print(f"{n} sessions written to {os.path.abspath(args.jsonl)}", file=sys.stderr)
            return 0
        now = time.time()
        summary = load_summary(run, now, policy)
        if args.json:
            summary["sessions_list"] = [rollout_stats.areal_record(r) for r in run.sessions()]
            json_out.dump(summary, sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            sys.stdout.write(render_text(summary))
        return 0
    finally:
        conn.close()


if __name__ == "__main__":
    sys.exit(main())
