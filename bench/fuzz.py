"""The protocol fuzzer, long: hostile peers against the real daemon (and relay) for a while.

Starts ``traceml-daemon serve`` (and, with ``--with-relay``, ``traceml-relay`` in
front of it), runs good peers whose every step row is known beside attacker
threads speaking the wire protocol (boundary ints, non-finite floats, huge and
odd strings, invalid UTF-8, many keys, deep nesting, wrong types, truncated and
stalled frames, idle sockets, seq jumps: ``tests/fuzz/protocol_fuzzer.py`` has
one function per kind), then stops everything cleanly and checks: the servers
stayed up, every good step is stored exactly once with its exact values, no
good peer was refused or cut off, peak RSS stayed under the cap.

    .venv/bin/python bench/fuzz.py                        # 30 minutes, daemon alone
    .venv/bin/python bench/fuzz.py --duration-s 300 --with-relay --seed 7
    .venv/bin/python bench/fuzz.py --each --duration-s 15  # every kind alone, a fresh daemon each

Prints the figures (per kind: messages sent and what came of them), the idle
RSS of the daemon measured in the same run as the baseline of its peak, every
broken invariant with its evidence, and ends with one line of JSON holding all
the figures. Exit status 1 when an invariant broke.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fuzz.protocol_fuzzer import KINDS, FuzzConfig, FuzzReport, run_fuzz  # noqa: E402


def _config(args: argparse.Namespace, workdir: Path, kinds: tuple[str, ...]) -> FuzzConfig:
    return FuzzConfig(
        duration_s=args.duration_s,
        seed=args.seed,
        with_relay=args.with_relay,
        workdir=workdir,
        rss_cap_mb=args.rss_cap_mb,
        kinds=kinds,
        workers=args.workers,
        torchrun_steps=args.torchrun_steps,
        same_address=args.same_address,
    )


def _verdict(report: FuzzReport) -> str:
    """One line per kind run alone: what broke, in a few words."""
    broken: list[str] = []
    for death in report.deaths:
        broken.append(f"{death.process.upper()} DOWN ({death.what})")
    for name, counts in report.probes.items():
        failed = sum(n for outcome, n in counts.items() if outcome != "ok")
        if failed and name in report.probe_failures:
            broken.append(f"{name} locked fresh connections out in {failed} probes")
    if report.daemon_peak_rss_mb > report.config.rss_cap_mb:
        broken.append(f"daemon RSS {report.daemon_peak_rss_mb:.0f} MB > cap")
    if report.relay_peak_rss_mb is not None and report.relay_peak_rss_mb > report.config.rss_cap_mb:
        broken.append(f"relay RSS {report.relay_peak_rss_mb:.0f} MB > cap")
    if report.good_steps_stored != report.good_steps_sent:
        broken.append(f"good steps {report.good_steps_stored}/{report.good_steps_sent} stored")
    if report.good_disruptions:
        broken.append(f"good peers disrupted {report.good_disruptions}x")
    if report.daemon_up and report.daemon_exit not in (0, None):
        broken.append(f"daemon exit {report.daemon_exit} on SIGTERM")
    return "; ".join(broken) or "ok"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=1800.0, help="seconds of fuzzing (per kind with --each)")
    parser.add_argument("--seed", type=int, default=0, help="seeds every generated message")
    parser.add_argument("--with-relay", action="store_true", help="a real traceml-relay in front of the daemon")
    parser.add_argument("--rss-cap-mb", type=float, default=600.0, help="peak RSS allowed to the daemon and the relay")
    parser.add_argument("--kinds", default="", help=f"comma-separated attack kinds (default all: {', '.join(KINDS)})")
    parser.add_argument("--each", action="store_true", help="run every kind alone against a fresh daemon")
    parser.add_argument("--workers", type=int, default=3, help="attacker threads")
    parser.add_argument("--torchrun-steps", type=int, default=0, help="also a real 2-rank torchrun job of this many steps")
    parser.add_argument("--same-address", action="store_true",
                        help="attackers connect from 127.0.0.1 like the good peers (default: other loopback addresses)")
    parser.add_argument("--workdir", default="", help="where the databases and logs go (default: a temporary directory)")
    args = parser.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k) or tuple(KINDS)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        parser.error(f"unknown kinds {unknown}; known: {', '.join(KINDS)}")
    root = Path(args.workdir or tempfile.mkdtemp(prefix="traceml-fuzz-"))
    print(f"workdir {root}", flush=True)

    if not args.each:
        report = run_fuzz(_config(args, root / "run", kinds))
        print(report.text())
        if report.problems:
            print("\n" + report.failure_message().split("\n\nfuzz: seed")[0])
        print(json.dumps({**report.figures(), "rss_baseline": "daemon_idle_rss_mb"}, default=str))
        return 1 if report.problems else 0

    verdicts: dict[str, str] = {}
    figures: dict[str, Any] = {}
    for kind in kinds:
        report = run_fuzz(_config(args, root / kind, (kind,)))
        verdicts[kind] = _verdict(report)
        figures[kind] = report.figures()
        outcomes = ", ".join(f"{k} {v}" for k, v in report.by_kind.get(kind, {}).get("outcomes", {}).items())
        print(f"{kind:<24} sent {report.messages:>6}  [{outcomes}]  -> {verdicts[kind]}", flush=True)
        for death in report.deaths:
            cause = [line for line in death.log_tail if "Error" in line or "error" in line][-2:]
            print(f"    {death.process} down at t={death.at_s}s ({death.what}): {' | '.join(cause)}", flush=True)
        for name, failures in report.probe_failures.items():
            print(f"    {name} probes: {'; '.join(failures[:3])}", flush=True)
    print(json.dumps({"duration_s": args.duration_s, "seed": args.seed, "with_relay": args.with_relay, "each": True,
                      "rss_cap_mb": args.rss_cap_mb, "verdicts": verdicts, "runs": figures}, default=str))
    return 1 if any(v != "ok" for v in verdicts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
