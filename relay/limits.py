"""Every connection limit of the relay, with its default, in one place.

The relay bounds its agent connections the way the daemon bounds its peers
(``traceml_daemon.net.limits.DAEMON_LIMITS``), with the same code
(``traceml_wire.limits``, ``traceml_wire.aio``). ``traceml-relay`` overrides
the ones a user may want to change; a relay that local rank 0 embeds uses these.
The keepalive settings also apply to the relay's own link to the daemon.
"""

from __future__ import annotations

from traceml_wire.framing import DEFAULT_MAX_FRAME_BYTES
from traceml_wire.limits import ConnectionLimits

RELAY_LIMITS = ConnectionLimits(
    # The ranks of one node, with room for CPU jobs that run one per core.
    max_connections=512,
    # An agent's hello takes one loopback round trip; the slots are for those in flight.
    max_unauthenticated=64,
    # A node's agents all connect from its loopback address: one address may use every slot.
    max_unauthenticated_per_address=64,
    hello_timeout=10.0,
    # Agents are on this host or its network and send a whole batch at once.
    read_timeout=10.0,
    # Agents send every flush while they run; a quiet one reconnects when it has data.
    idle_timeout=300.0,
    # One frame at the agent cap at a time: this is what a relay inside a trainer may
    # hold of frames being read, however many sockets are open.
    inbound_bytes=DEFAULT_MAX_FRAME_BYTES,
    # The daemon link crosses the network: a vanished daemon is found well before
    # the idle timeout would notice.
    keepalive_idle=60,
    keepalive_interval=10,
    keepalive_count=6,
)
