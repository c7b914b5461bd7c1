"""Address checks shared by relay and daemon (pure, stdlib only)."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """True for a host that only this machine can reach. A bind anywhere else
    exposes the port, so relay and daemon refuse it without a token."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
