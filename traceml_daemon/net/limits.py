"""Every connection limit of the daemon, with its default, in one place.

``serve`` overrides the ones a user may want to change (``--max-connections``,
``--max-unauthenticated``, ``--max-unauthenticated-per-address``,
``--hello-timeout``, ``--read-timeout``, ``--idle-timeout``,
``--inbound-bytes``); the frame cap is ``--max-frame-bytes``
(``traceml_wire.framing``). The relay's are ``relay.limits.RELAY_LIMITS``.
"""

from __future__ import annotations

from traceml_wire.limits import ConnectionLimits

DAEMON_LIMITS = ConnectionLimits(
    # One relay per node, or one agent per rank talking directly.
    max_connections=1024,
    # A hello takes one round trip: these slots are busy only for a moment each, unless
    # someone keeps sockets open without a hello, which is what the caps are for.
    max_unauthenticated=128,
    max_unauthenticated_per_address=16,
    hello_timeout=10.0,
    # A frame at the full cap arrives in this time over any live link.
    read_timeout=30.0,
    # Relays send many times a minute while their agents run; a relay gone quiet just reconnects.
    idle_timeout=300.0,
    inbound_bytes=32 * 1024 * 1024,
    # A peer whose host vanished is found well before the idle timeout.
    keepalive_idle=60,
    keepalive_interval=10,
    keepalive_count=6,
)
