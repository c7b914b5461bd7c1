"""Local rank 0 hosts its node's relay inside the training process.

The runtime starts it on the sender thread (never the training one) and stops it
at shutdown within what is left of the one shutdown budget. A relay that already
serves the node (a standalone traceml-relay, or another rank's) is no failure:
the agent simply connects to it.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import Any

from agent.config import Config
from agent.errors import ErrorReporter
from agent.identity import Identity

RelayStarter = Callable[..., Any]


def default_relay_starter() -> RelayStarter:
    from relay.node import start_relay_thread  # lazy: only local rank 0 needs it

    return start_relay_thread


def port_in_use(exc: BaseException) -> bool:
    """The relay could not bind because something already listens on its port."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.EADDRINUSE:
            return True
        if "address already in use" in str(seen).lower():
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def start_node_relay(
    config: Config, identity: Identity, relay_starter: Callable[[], RelayStarter], reporter: ErrorReporter
) -> Any:
    """The relay this rank now hosts; None on any rank but local rank 0, or when it could not start."""
    if identity.local_rank != 0:
        return None
    try:
        start = relay_starter()
        return start(
            port=config.relay_port,
            upstream=config.daemon,
            token=config.token,
            session=identity.session,
            node={"node_rank": identity.node_rank, "hostname": identity.hostname},
            spool_dir=None,
            tls_ca=config.tls_ca,
        )
    except Exception as exc:
        if port_in_use(exc):
            # A standalone traceml-relay (or another rank) already serves
            # this node: just connect to it.
            reporter.count("relay-port-in-use")
        else:
            reporter.report("relay", f"could not start the node relay: {exc!r}")
        return None


def stop_node_relay(relay: Any, budget_s: float, reporter: ErrorReporter) -> None:
    """Stop within ``budget_s``, what is left of the shutdown budget (TRACEML_SHUTDOWN_S).

    Waiting for the node's other agents and the final flush upstream share it, never more.
    """
    try:
        relay.stop(budget_s / 2, agent_grace=budget_s / 2)
    except Exception as exc:
        reporter.report("relay", f"node relay did not stop cleanly: {exc!r}")
