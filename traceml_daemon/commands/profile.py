"""`traceml-daemon profile --db PATH --rank R --steps K [--session ID]`: profile a running rank.

Asks rank R of a live run to record its next K steps with torch.profiler and
waits for the trace file. How the request travels:

  * CLI -> daemon, ``--daemon HOST:PORT``: a one-shot connection of role
    ``control`` to the daemon's port (``profile_wire``), with the challenge,
    hello MAC and accept proof every relay uses (the token proves both sides);
    the daemon answers whether it sent the request down. With ``--db`` as well,
    the rank is checked in, and the trace waited for from, that database.
  * CLI -> daemon, ``--db PATH`` alone: a request file in ``PATH.control/``, the directory the daemon
    serving ``PATH`` creates (mode 0700) and polls; it answers with a result
    file (``traceml_daemon.net.control_requests``). Whoever can write beside
    the database can read all of it already: the directory's permissions are
    the authentication, as the token is on the wire.
  * daemon -> relay -> agent: a ``control`` message down the connections that
    already exist, authenticated at their handshake, only on the connection that
    carries rank R (``traceml_daemon.net.routes``, ``relay.node``); the agent
    starts the profile at its next step boundary (``agent.control``).
  * the trace: the agent writes it (TRACEML_PROFILE_DIR) and reports it in the
    ``profiles`` table like ``profile_steps``; this command waits for that row.

Errors name what was wrong (no such rank, the run finished, no daemon serving
the database, an agent or relay too old to take the request) and what to do.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from traceml_daemon.net.control_requests import REQUEST_SUFFIX, RESULT_SUFFIX, control_dir, write_json
from traceml_daemon.store import reader
from traceml_daemon.store.read import profiles
from traceml_wire import messages

DEFAULT_DB = "traceml.db"
ANSWER_TIMEOUT_S = 5.0  # the daemon polls its request directory several times a second
DEFAULT_WAIT_S = 120.0  # for the trace: K steps plus a flush or two
POLL_S = 0.2


class ProfileError(Exception):
    """What went wrong and what to do; exit 2."""


@dataclass(frozen=True)
class Requested:
    """A request the daemon sent down: the rank's sender, and the profiles rows before it."""

    request_id: str
    session: str
    rank: int
    steps: int
    profiles_before: int


@dataclass(frozen=True)
class Trace:
    rank: int
    step: int
    steps: int
    path: str


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", default=None,
                        help=f"the database a running daemon serves (default ./{DEFAULT_DB}; with --daemon: optional, "
                             "read to check the rank and wait for the trace)")
    parser.add_argument("--daemon", default=None, metavar="HOST:PORT",
                        help="ask the daemon over its port instead (authenticated like relays: --token-file or "
                             "$TRACEML_TOKEN)")
    parser.add_argument("--token-file", default=None, help="file holding the shared token (else $TRACEML_TOKEN)")
    parser.add_argument("--tls-ca", default=None, help="CA file that verifies the daemon's TLS certificate")
    parser.add_argument("--rank", type=int, required=True, help="the global rank to profile")
    parser.add_argument("--steps", type=int, default=3,
                        help=f"how many steps to record, 1..{messages.MAX_PROFILE_STEPS} (default 3)")
    parser.add_argument("--session", default=None, help="this session (default: the latest run; `runs` lists them)")
    parser.add_argument("--wait", type=float, default=DEFAULT_WAIT_S,
                        help=f"seconds to wait for the trace (default {DEFAULT_WAIT_S:.0f}; 0: do not wait)")
    parser.add_argument("--json", action="store_true", help="print the trace as JSON")


# ---------------------------------------------------------------- the run


def _run_ranks(db: str, session: str | None, rank: int) -> tuple[reader.RunRef, list[int]]:
    """The run and the rank ids of ``rank`` in it; ProfileError when the rank is not in the run."""
    conn = reader.open_readonly(db)
    try:
        run = reader.resolve_run(conn, session)
        if run is None:
            raise ProfileError(f"{db} holds no run yet: start the job, or check --db")
        rows = reader.load_ranks(conn, run)
    finally:
        conn.close()
    ids = [r.rank_id for r in rows if r.global_rank == rank]
    if not ids:
        from traceml_daemon.analysis.stats import rank_ranges

        known = rank_ranges(r.global_rank for r in rows if r.global_rank is not None) or "none"
        raise ProfileError(f"no rank {rank} in session {run.session} (ranks {known}): pick one of those with --rank")
    return run, ids


def _last_seen(db: str, rank_ids: list[int]) -> float | None:
    conn = reader.open_readonly(db)
    try:
        return profiles.last_seen(conn, rank_ids)
    finally:
        conn.close()


def new_traces(db: str, rank: int, rank_ids: list[int], after: int) -> list[Trace]:
    """Trace files rank ``rank`` reported after profiles rowid ``after``."""
    conn = reader.open_readonly(db)
    try:
        return [Trace(rank, step, steps, path) for step, steps, path in profiles.profiles_after(conn, rank_ids, after)]
    finally:
        conn.close()


# ---------------------------------------------------------------- the request


def request(db: str, rank: int, steps: int, session: str | None = None,
            answer_timeout: float = ANSWER_TIMEOUT_S) -> Requested:
    """Ask the daemon serving ``db`` to send the request down; ProfileError says why it could not."""
    _check_steps(steps)
    run, rank_ids, before = _in_run(db, rank, session)
    directory = control_dir(db)
    if not directory.is_dir():
        raise ProfileError(f"no daemon serves {db} (no {directory}/): start `traceml-daemon serve --db {db}` "
                           "(or `traceml-daemon launch`) and run the job under it, or ask it with --daemon HOST:PORT")
    request_id = secrets.token_hex(8)
    body = {"op": messages.OP_PROFILE, "rank": rank, "steps": steps, "session": run.session}
    try:
        write_json(directory / f"{request_id}{REQUEST_SUFFIX}", body)
    except OSError as exc:
        raise ProfileError(f"cannot write the request into {directory}: {exc.strerror or exc}; "
                           "run this as the user who runs the daemon") from None
    answer = _await_answer(directory, request_id, answer_timeout)
    if answer is None:
        with contextlib.suppress(OSError):
            (directory / f"{request_id}{REQUEST_SUFFIX}").unlink()
        raise ProfileError(f"the daemon serving {db} did not answer within {answer_timeout:.0f} s: "
                           f"is `traceml-daemon serve --db {db}` still running?")
    if answer.get("status") != "sent":
        raise ProfileError(_refusal(str(answer.get("message", "refused")), db, rank, run.session, rank_ids))
    return Requested(request_id, run.session, rank, steps, before)


def request_over_wire(address: str, token: str | None, rank: int, steps: int, session: str | None = None,
                      db: str | None = None, tls_ca: str | None = None) -> Requested | None:
    """Ask the daemon at ``address`` (profile_wire); with ``db`` (that daemon's database, read
    here) the rank is checked first and the trace can be waited for (None without ``db``)."""
    from traceml_daemon.commands.profile_wire import WireError, ask

    _check_steps(steps)
    known = _in_run(db, rank, session) if db is not None else None
    request_id = secrets.token_hex(8)
    try:
        answer = ask(address, token, rank, steps, request_id, known[0].session if known else session, tls_ca)
    except WireError as exc:
        raise ProfileError(str(exc)) from None
    if answer.status != "sent":
        if known is None:
            raise ProfileError(answer.message)
        raise ProfileError(_refusal(answer.message, str(db), rank, known[0].session, known[1]))
    if known is None:
        return None
    return Requested(request_id, known[0].session, rank, steps, known[2])


def _check_steps(steps: int) -> None:
    if not 1 <= steps <= messages.MAX_PROFILE_STEPS:
        raise ProfileError(f"--steps {steps}: ask for 1 to {messages.MAX_PROFILE_STEPS} steps")


def _in_run(db: str, rank: int, session: str | None) -> tuple[reader.RunRef, list[int], int]:
    """The run, the rank's ids in it and the profiles mark now; ProfileError when the rank is not in it."""
    if not os.path.exists(db):
        raise ProfileError(f"no database at {db}: give the --db a running `traceml-daemon serve` writes")
    run, rank_ids = _run_ranks(db, session, rank)
    conn = reader.open_readonly(db)
    try:
        return run, rank_ids, profiles.profiles_mark(conn)
    finally:
        conn.close()


def _refusal(message: str, db: str, rank: int, session: str, rank_ids: list[int]) -> str:
    if "not connected" not in message:
        return message
    # The rank is in the run (checked before asking) but no connection carries it now.
    seen = _last_seen(db, rank_ids)
    ago = f" (its last data {max(0.0, time.time() - seen):.0f} s ago)" if seen is not None else ""
    return (f"rank {rank} of session {session} is not connected{ago}: the run finished or the rank lost its "
            "connection; profile a running job")


def _await_answer(directory: Path, request_id: str, timeout: float) -> dict[str, Any] | None:
    path = directory / f"{request_id}{RESULT_SUFFIX}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            answer = json.loads(path.read_text())
        except (OSError, ValueError):
            time.sleep(0.05)
            continue
        with contextlib.suppress(OSError):
            path.unlink()
        return answer if isinstance(answer, dict) else {"status": "refused", "message": "unreadable answer"}
    return None


def wait_for_trace(db: str, requested: Requested, wait: float) -> Trace | None:
    """The trace the rank reports for the request, or None after ``wait`` seconds."""
    _, rank_ids = _run_ranks(db, requested.session, requested.rank)
    deadline = time.monotonic() + wait
    while True:
        found = new_traces(db, requested.rank, rank_ids, requested.profiles_before)
        if found:
            return found[0]
        if time.monotonic() >= deadline:
            return None
        time.sleep(POLL_S)


# ---------------------------------------------------------------- main


def main(args: argparse.Namespace | list[str] | None = None) -> int:
    if not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(prog="traceml-daemon profile",
                                         description="Profile a running rank's next steps with torch.profiler.")
        add_arguments(parser)
        args = parser.parse_args(args)
    try:
        if args.daemon:
            from traceml_daemon.commands.cli import UsageError, read_token

            try:
                token = read_token(args.token_file)
            except UsageError as exc:
                raise ProfileError(str(exc)) from None
            found = request_over_wire(args.daemon, token, args.rank, args.steps, args.session, args.db, args.tls_ca)
            if found is None:
                print(f"asked rank {args.rank} through {args.daemon} to profile its next {args.steps} steps; the "
                      "trace is listed by `summary` and `inspect` on that daemon's database once written "
                      "(give --db to wait for it here)")
                return 0
            requested = found
        else:
            args.db = args.db or DEFAULT_DB
            requested = request(args.db, args.rank, args.steps, args.session)
        print(f"asked rank {args.rank} of session {requested.session} to profile its next {args.steps} steps",
              file=sys.stderr, flush=True)
        if args.wait <= 0:
            return 0
        trace = wait_for_trace(args.db, requested, args.wait)
    except ProfileError as exc:
        print(f"traceml-daemon profile: {exc}", file=sys.stderr)
        return 2
    except reader.StoreError as exc:
        print(f"traceml-daemon profile: {exc}", file=sys.stderr)
        return 2
    except reader.UnknownSession as exc:
        print(f"traceml-daemon profile: {args.db}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if trace is None:
        print(f"traceml-daemon profile: no trace from rank {args.rank} within {args.wait:.0f} s: the rank may be "
              "between steps for longer (wait with a larger --wait, then see `summary`), or its agent or relay is "
              "too old to take requests", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(trace.__dict__))
    else:
        last = trace.step + trace.steps - 1
        print(f"rank {trace.rank} steps {trace.step}-{last} ({trace.steps} steps): {trace.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
