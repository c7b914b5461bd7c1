"""``traceml-daemon`` command line: argument parsing and dispatch only.

``serve``, ``summary`` and ``ingest`` live here; ``demo``, ``tui``, ``compare``,
``export``, ``runs`` and ``launch`` belong to their own modules, imported only when that
subcommand runs (so ``traceml-daemon summary`` never loads textual). Each such
module provides ``add_arguments(parser)`` and ``main(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from types import ModuleType

from traceml_daemon.analysis.policy import Policy
from traceml_daemon.net.limits import DAEMON_LIMITS
from traceml_daemon.net.verdict_profiles import DEFAULT_STEPS as PROFILE_ON_VERDICT_STEPS
from traceml_daemon.net.verdict_profiles import MAX_PROFILES_PER_RUN as PROFILE_ON_VERDICT_PER_RUN
from traceml_daemon.store.retention import DEFAULT_MAX_DB_MB, DEFAULT_RETENTION_DAYS
from traceml_wire.framing import DEFAULT_MAX_FRAME_BYTES
from traceml_wire.limit_flags import add_limit_arguments, limits_from_args
from traceml_wire.messages import MAX_PROFILE_STEPS

DEFAULT_DB = "traceml.db"
DEFAULT_PORT = 29765

LAZY: dict[str, tuple[str, str]] = {
    "demo": ("traceml_daemon.commands.demo", "a local simulated 2 nodes x 2 ranks CPU DDP job, end to end"),
    "tui": ("traceml_daemon.tui.app", "attach the terminal UI to a live or finished run (read-only)"),
    "compare": ("traceml_daemon.commands.compare", "two runs side by side, first divergent step"),
    "export": ("traceml_daemon.commands.export", "export a run as a Chrome trace or CSV"),
    "runs": ("traceml_daemon.commands.runs", "list the runs (sessions) in a database"),
    "launch": ("traceml_daemon.commands.launch", "start a daemon and a training command together"),
    "validate": ("traceml_daemon.commands.validate", "check a database or relay spool for damage (exit 3)"),
    "logs": ("traceml_daemon.commands.logs", "rank output, identical lines folded across ranks, errors first"),
    "inspect": ("traceml_daemon.commands.inspect", "everything every rank recorded at one step"),
    "profile": ("traceml_daemon.commands.profile", "profile a running rank's next steps with torch.profiler"),
    "sessions": ("traceml_daemon.commands.sessions", "rollout session records (AReaL JSONL layout) and their summary"),
}


class UsageError(Exception):
    """A mistake the user can fix; printed without a traceback, exit 2."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be above 0")
    return value


def _profile_steps(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_PROFILE_STEPS:
        raise argparse.ArgumentTypeError(f"{value}: profile 1 to {MAX_PROFILE_STEPS} steps")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be 0 or more (0: off)")
    return value


def add_policy_argument(p: argparse.ArgumentParser) -> None:
    """``--policy FILE``: serve, summary and tui read thresholds from it (docs/diagnosis.md)."""
    p.add_argument("--policy", metavar="FILE",
                   help="TOML file overriding diagnosis thresholds by section and key, e.g. [stragglers] "
                        "min_excess_frac = 0.2 (docs/diagnosis.md lists them)")


def load_policy_arg(path: str | None) -> Policy | None:
    """The policy of ``--policy`` (None: the defaults); UsageError naming the file and key."""
    if path is None:
        return None
    from traceml_daemon.analysis.policy_file import PolicyFileError, load_policy

    try:
        return load_policy(path)
    except PolicyFileError as exc:
        raise UsageError(str(exc)) from None


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; others need a token)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT}; 0 = any free)")
    p.add_argument("--db", default=DEFAULT_DB, help=f"SQLite database (default ./{DEFAULT_DB})")
    p.add_argument("--token-file", help="file holding the shared token (else $TRACEML_TOKEN)")
    p.add_argument("--tui", action="store_true", help="show the live terminal UI while serving")
    p.add_argument("--max-frame-bytes", type=_positive_int, default=DEFAULT_MAX_FRAME_BYTES,
                   help="largest frame accepted")
    # The connection limits; their defaults are DAEMON_LIMITS (traceml_daemon/net/limits.py).
    add_limit_arguments(p, DAEMON_LIMITS)
    p.add_argument("--queue-bytes", type=_positive_int, default=64 * 1024 * 1024,
                   help="bytes queued for the writer (and in its transaction) before reads pause")
    p.add_argument("--tls-cert", help="PEM certificate: serve TLS")
    p.add_argument("--tls-key", help="PEM private key for --tls-cert")
    p.add_argument("--log-level", default="INFO", help="stderr log level (default INFO)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus/OpenMetrics on GET /metrics at this port")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address of --metrics-port (default 127.0.0.1)")
    p.add_argument("--retention-days", type=_non_negative_float,
                   help="delete raw rows older than this many days; history stays "
                        f"(default {DEFAULT_RETENTION_DAYS:g}; 0: none by age)")
    p.add_argument("--max-db-mb", type=_non_negative_float,
                   help=f"delete the oldest raw rows while the db uses more than this many MiB; history stays "
                        f"(default {DEFAULT_MAX_DB_MB:g}; 0: no size cap)")
    p.add_argument("--keep-everything", action="store_true",
                   help="no retention at all: --retention-days 0 --max-db-mb 0")
    add_policy_argument(p)
    p.add_argument("--profile-on-verdict", type=_profile_steps, nargs="?", const=PROFILE_ON_VERDICT_STEPS,
                   default=None, metavar="K",
                   help="profile the rank a straggler verdict names: its next K steps with torch.profiler "
                        f"(default {PROFILE_ON_VERDICT_STEPS}), once per rank, at most {PROFILE_ON_VERDICT_PER_RUN} "
                        "per run (docs/tracing.md)")
    p.add_argument("--shared-files", action="store_true",
                   help="make the database, logs and summaries readable by others (default: owner only, 0600)")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="traceml-daemon", description="TraceML daemon: ingest, store, diagnose.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _serve_args(sub.add_parser("serve", help="receive telemetry from relays and store it"))
    p = sub.add_parser("summary", help="final summary of the latest run (text, or JSON with --json)")
    p.add_argument("--db", default=DEFAULT_DB, help=f"database (default ./{DEFAULT_DB})")
    p.add_argument("--json", action="store_true", help="print JSON on stdout")
    p.add_argument("--no-files", action="store_true", help="do not write final_summary.json/.txt next to the db")
    p.add_argument("--session", default=None, help="this session (default: the latest run; `runs` lists them)")
    add_policy_argument(p)
    p = sub.add_parser("ingest", help="load relay spool files into a database")
    p.add_argument("files", nargs="+", help="spool files written by relays")
    p.add_argument("--db", default=DEFAULT_DB, help=f"database (default ./{DEFAULT_DB})")
    for name, (_module, text) in LAZY.items():
        p = sub.add_parser(name, help=text)
        if name == command:
            # Only the subcommand being run pays for its import.
            _lazy_module(name).add_arguments(p)
    return parser


def _lazy_module(name: str) -> ModuleType:
    module_name = LAZY[name][0]
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise UsageError(f"`{name}` is not available in this installation ({module_name} is missing)") from None
        raise


def read_token(token_file: str | None) -> str | None:
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as fh:
                token = fh.read().strip()
        except OSError as exc:
            raise UsageError(f"cannot read --token-file {token_file}: {exc.strerror}") from None
        if not token:
            raise UsageError(f"--token-file {token_file} is empty")
        return token
    return os.environ.get("TRACEML_TOKEN") or None


def cmd_serve(args: argparse.Namespace) -> int:
    from traceml_daemon.net import loop as _loop
    from traceml_daemon.net.server import ServerConfig, run_server
    from traceml_daemon.store.migrate import SchemaError
    from traceml_daemon.store.permissions import restrict_files
    from traceml_wire.addresses import is_loopback

    token = read_token(args.token_file)
    if token is None and not is_loopback(args.host):
        raise UsageError(
            f"refusing to listen on non-loopback address {args.host} without a token: anyone who can reach it "
            "could write to the database. Set TRACEML_TOKEN (same value on every node) or pass --token-file FILE, "
            "or bind --host 127.0.0.1."
        )
    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("--tls-cert and --tls-key go together")
    retention_days, max_db_mb = serve_retention(args)
    policy = load_policy_arg(args.policy)
    restrict_files(args.db, shared=args.shared_files)
    config = ServerConfig(
        db_path=args.db,
        host=args.host,
        port=args.port,
        token=token,
        max_frame_bytes=args.max_frame_bytes,
        queue_bytes=args.queue_bytes,
        limits=limits_from_args(DAEMON_LIMITS, args),
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        retention_days=retention_days,
        max_db_mb=max_db_mb,
        policy=policy,
        profile_on_verdict=args.profile_on_verdict,
    )
    logging.getLogger("traceml_daemon.commands.cli").info("retention: %s", retention_text(retention_days, max_db_mb))
    if args.tui:
        return _serve_with_tui(args.db, policy)
    try:
        code = _loop.run(run_server(config))
    except SchemaError as exc:
        raise UsageError(str(exc)) from None
    if code == 0:
        _final_summary(args.db, policy)
    return code


def serve_retention(args: argparse.Namespace) -> tuple[float | None, float | None]:
    """(days, MiB) of retention, None where off: serve is bounded unless told otherwise."""
    days = DEFAULT_RETENTION_DAYS if args.retention_days is None else args.retention_days
    mb = DEFAULT_MAX_DB_MB if args.max_db_mb is None else args.max_db_mb
    if args.keep_everything:
        if args.retention_days or args.max_db_mb:
            raise UsageError("--keep-everything turns retention off: leave out --retention-days and --max-db-mb")
        days = mb = 0.0
    return days or None, mb or None


def retention_text(days: float | None, mb: float | None) -> str:
    """What serve keeps, for its log: an operator sees the bounds without reading the flags."""
    if days is None and mb is None:
        return "off (--keep-everything): every raw row is kept"
    age = f"raw rows kept {days:g} days" if days else "no age limit"
    size = f"database capped at {mb:g} MiB" if mb else "no size cap"
    return f"{age}, {size}; history is kept"


def _final_summary(db_path: str, policy: Policy | None = None) -> None:
    """Leave final_summary.json/.txt beside the db after a clean stop; a failure
    here is logged, never turned into a failed daemon exit."""
    from traceml_daemon.commands.summary import build_summary, write_summary_files

    log = logging.getLogger("traceml_daemon.commands.cli")
    try:
        summary = build_summary(db_path, policy)
        if summary["ranks"]:
            paths = write_summary_files(db_path, summary)
            log.info("final summary written to %s", ", ".join(paths))
    except Exception:
        log.exception("could not write the final summary")


def _serve_with_tui(db_path: str, policy: Policy | None = None) -> int:
    """Serve in a child process and run the TUI here: the TUI owns the terminal
    and its event loop, and a slow redraw must never stall ingest."""
    import subprocess

    argv = [a for a in sys.argv[1:] if a != "--tui"]
    log_path = os.path.join(os.path.dirname(os.path.abspath(db_path)), "traceml-daemon.log")
    with open(log_path, "ab") as log_file:
        # The TUI owns the terminal, so the daemon's log goes to a file beside the db.
        child = subprocess.Popen(
            [sys.executable, "-m", "traceml_daemon.commands.cli", *argv], stdout=subprocess.DEVNULL, stderr=log_file
        )
    print(f"daemon log: {log_path}", file=sys.stderr)
    try:
        tui = _lazy_module("tui")
        return int(tui.run_tui(db_path, policy) or 0)
    finally:
        child.terminate()
        child.wait()


def cmd_summary(args: argparse.Namespace) -> int:
    from traceml_daemon.commands.summary import build_summary, render_text, write_summary_files
    from traceml_daemon.store.reader import StoreError, UnknownSession

    policy = load_policy_arg(args.policy)
    try:
        summary = build_summary(args.db, policy, session=args.session)
    except StoreError as exc:
        raise UsageError(str(exc)) from None
    except UnknownSession as exc:
        raise UsageError(f"{args.db}: {exc}") from None
    if not args.no_files:
        try:
            write_summary_files(args.db, summary)
        except OSError as exc:
            logging.getLogger("traceml_daemon.commands.cli").warning("could not write summary files: %s", exc)
    if args.json:
        from traceml_daemon.commands import json_out

        json_out.dump(summary, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_text(summary))
    return 0


def cmd_ingest(args: argparse.Namespace) -> int:
    from traceml_daemon.commands.ingest import ingest_spools
    from traceml_daemon.net import loop as _loop
    from traceml_daemon.store.migrate import SchemaError

    try:
        reports = _loop.run(ingest_spools(args.files, args.db))
    except SchemaError as exc:
        raise UsageError(str(exc)) from None
    for report in reports:
        print(report.line())
    # A damaged spool is not a failure of the command: what was intact is stored.
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and argv[0] in LAZY else None
    try:
        try:
            args = build_parser(command).parse_args(argv)
        except SystemExit as exc:
            # compare and validate promise exit 1 for a usage error (argparse says 2: their I/O error)
            usage_exit = getattr(_lazy_module(command), "USAGE_EXIT", None) if command else None
            if usage_exit is not None and exc.code == 2:
                return int(usage_exit)
            raise
        logging.basicConfig(
            level=getattr(args, "log_level", "INFO").upper(),
            stream=sys.stderr,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "summary":
            return cmd_summary(args)
        if args.command == "ingest":
            return cmd_ingest(args)
        return int(_lazy_module(args.command).main(args) or 0)
    except UsageError as exc:
        print(f"traceml-daemon: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
