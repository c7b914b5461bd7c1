"""The daemon's own policy around one connection's conversation.

The conversation itself (challenge, hello MAC, accept with the proof of the
token, which message is legal when, the frame cap of each state) is
``traceml_wire.server_connection.ServerConnection``; the server shell feeds it the
bytes it reads. What is the daemon's alone lives here: the identity cache
bound from its ingest policy, and the one batch shape the rest of the daemon
sees (an agent talking to the daemon directly acts as its own relay).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from traceml_daemon.store.policy import DEFAULT_POLICY
from traceml_wire import connection_events as conv
from traceml_wire.framing import DEFAULT_MAX_FRAME_BYTES
from traceml_wire.server_connection import ServerConnection


@dataclass
class Batch:
    """A numbered batch, normalised to the relay shape (``batch`` from an agent
    becomes a one-item rbatch with the agent as its own relay)."""

    seq: int
    items: list[list[Any]]
    peers: dict[str, dict[str, Any]]
    node: dict[str, Any]
    stats: dict[str, int]
    nbytes: int


def new_connection(token: str | None, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> ServerConnection:
    """The server side of one peer's conversation, agents and relays both welcome."""
    return ServerConnection(
        token, max_frame_bytes=max_frame_bytes, identity_cache_entries=DEFAULT_POLICY.identity_cache_entries
    )


def as_batch(hello: conv.Hello, event: conv.Batch | conv.RelayBatch) -> Batch:
    """``event`` in the rbatch shape: only relays send rbatches, so the rest of the
    daemon never needs to know an agent connected directly."""
    if isinstance(event, conv.RelayBatch):
        return Batch(event.seq, event.items, event.peers, event.node, event.stats, event.nbytes)
    identity = hello.identity
    node = {k: identity[k] for k in ("node_rank", "hostname") if k in identity}
    return Batch(
        seq=event.seq,
        items=[[hello.sender, event.seq, event.body]],
        peers={hello.sender: identity},
        node=node,
        stats={},
        nbytes=event.nbytes,
    )


def tls_hint(declared: int | None) -> str:
    """A hint for the log when an oversize "header" is a TLS ClientHello (0x16 0x03):
    a relay given a CA file talking to a plaintext daemon."""
    if declared is not None and declared >> 16 == 0x1603:
        return " (a TLS client hello: this daemon serves plaintext, start it with --tls-cert)"
    return ""
