"""``traceml-relay``: the NodeRelay as a standalone process (sidecars, Slurm).

Same code as the relay the agent starts in-process; runs until SIGINT/SIGTERM,
then flushes what it holds to the daemon (bounded by --flush-timeout) and
exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
from typing import Any

from relay._loop import run
from relay.limits import RELAY_LIMITS
from relay.node import DEFAULT_PORT, NodeRelay, default_spool_dir, parse_hostport
from traceml_wire.limit_flags import add_limit_arguments, limits_from_args


def _port(value: str) -> int:
    if not value.isdigit() or not 0 <= int(value) < 65536:
        raise argparse.ArgumentTypeError(f"port must be an integer in 0..65535, got {value!r}")
    return int(value)


def _hostport(value: str) -> tuple[str, int]:
    try:
        return parse_hostport(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _nonneg(value: str) -> int:
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value!r}")
    return int(value)


def _env_node_rank() -> int:
    for name in ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def _env_session() -> str:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return run_id
    for name in ("SLURM_JOB_ID", "TRACEML_SESSION"):
        if os.environ.get(name):
            return os.environ[name]
    return f"local-{os.getppid()}"


def build_parser() -> argparse.ArgumentParser:
    env_port = os.environ.get("TRACEML_RELAY_PORT")
    parser = argparse.ArgumentParser(prog="traceml-relay", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="listen address (non-loopback needs a token)")
    parser.add_argument("--port", type=_port, default=None, help=f"agent port (TRACEML_RELAY_PORT, default {DEFAULT_PORT})")
    parser.add_argument("--daemon", type=_hostport, default=None, help="daemon host:port (TRACEML_DAEMON, default 127.0.0.1:29765)")
    parser.add_argument("--token-file", default=None, help="file holding the shared token (else TRACEML_TOKEN)")
    parser.add_argument("--node-rank", type=_nonneg, default=None, help="node rank (else GROUP_RANK/NODE_RANK/SLURM_NODEID)")
    parser.add_argument("--session", default=None, help="session id (else TORCHELASTIC_RUN_ID/SLURM_JOB_ID/TRACEML_SESSION)")
    parser.add_argument("--spool-dir", default=None, help="spool directory (TRACEML_SPOOL_DIR, default per session under the temp dir)")
    parser.add_argument(
        "--tls-ca",
        default=os.environ.get("TRACEML_TLS_CA") or None,
        help="CA file that signed the daemon's --tls-cert: connect over TLS (else TRACEML_TLS_CA)",
    )
    parser.add_argument("--flush-timeout", type=float, default=5.0, help="seconds to flush on shutdown")
    # The agent connection limits; their defaults are RELAY_LIMITS (relay/limits.py).
    add_limit_arguments(parser, RELAY_LIMITS)
    parser.set_defaults(env_port=env_port)
    return parser


def _config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    port = args.port
    if port is None:
        try:
            port = _port(args.env_port) if args.env_port else DEFAULT_PORT
        except argparse.ArgumentTypeError as exc:
            parser.error(f"TRACEML_RELAY_PORT: {exc}")
    daemon = args.daemon
    if daemon is None:
        try:
            daemon = parse_hostport(os.environ.get("TRACEML_DAEMON") or "127.0.0.1:29765")
        except ValueError as exc:
            parser.error(f"TRACEML_DAEMON: {exc}")
    token = os.environ.get("TRACEML_TOKEN") or None
    if args.token_file:
        try:
            with open(args.token_file, encoding="utf-8") as fh:
                token = fh.read().strip() or None
        except OSError as exc:
            parser.error(f"--token-file: cannot read {args.token_file}: {exc.strerror}")
    if args.tls_ca and not os.path.isfile(args.tls_ca):
        parser.error(f"--tls-ca (or TRACEML_TLS_CA): no such file {args.tls_ca}")
    session = args.session or _env_session()
    node_rank = args.node_rank if args.node_rank is not None else _env_node_rank()
    return {
        "host": args.host,
        "port": port,
        "upstream": daemon,
        "token": token,
        "session": session,
        "node": {"node_rank": node_rank, "hostname": socket.gethostname()},
        "spool_dir": args.spool_dir or default_spool_dir(session),
        "tls_ca": args.tls_ca,
        "limits": limits_from_args(RELAY_LIMITS, args),
    }


async def _serve(config: dict[str, Any], flush_timeout: float) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    relay = NodeRelay(**config)
    await relay.start()
    print(f"[traceml] relay listening on {relay.host}:{relay.port}, daemon {config['upstream'][0]}:{config['upstream'][1]}", file=sys.stderr, flush=True)
    await stop.wait()
    await relay.aclose(flush_timeout)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    config = _config(parser, args)
    try:
        run(_serve(config, args.flush_timeout))
    except ValueError as exc:  # e.g. non-loopback bind without a token
        print(f"traceml-relay: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"traceml-relay: error: cannot listen on {config['host']}:{config['port']}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
