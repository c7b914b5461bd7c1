"""NodeRelay: the per-node loopback server that forwards agent batches to the daemon.

Imports asyncio, the wire module and (optionally) uvloop; never torch, and it
never unpacks rank payload bodies.
"""

from relay.node import DEFAULT_PORT, NodeRelay, RelayHandle, start_relay_thread

__all__ = ["DEFAULT_PORT", "NodeRelay", "RelayHandle", "start_relay_thread"]
