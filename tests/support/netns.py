"""Two simulated hosts on one machine: network namespaces joined by a veth pair.

Each namespace has its own loopback (so each "node" has its own relay on
127.0.0.1:$TRACEML_RELAY_PORT, as on real hosts) and one veth end with an
address on a private /24 that exists only inside this sandbox. Both share the
machine's UTS namespace, so both report the same hostname: exactly the case
where node identity must not rest on the hostname.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


def netns_unavailable_reason() -> str | None:
    """Why the harness cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (CI runs as root)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` command"
    probe = f"tmlprobe{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass(frozen=True)
class Host:
    netns: str
    ifname: str
    address: str

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns]

    def link(self, up: bool) -> None:
        """Take this host's veth end down or up (a network partition)."""
        _ip("netns", "exec", self.netns, "ip", "link", "set", self.ifname, "up" if up else "down")


@contextmanager
def two_hosts(subnet: str = "10.231.77") -> Iterator[tuple[Host, Host]]:
    """Create two namespaces joined by a veth pair; always torn down."""
    tag = uuid.uuid4().hex[:6]
    hosts = (Host(f"tml{tag}a", f"tv{tag}a", f"{subnet}.1"), Host(f"tml{tag}b", f"tv{tag}b", f"{subnet}.2"))
    try:
        for h in hosts:
            _ip("netns", "add", h.netns)
        _ip("link", "add", hosts[0].ifname, "type", "veth", "peer", "name", hosts[1].ifname)
        for h in hosts:
            _ip("link", "set", h.ifname, "netns", h.netns)
            _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", h.ifname)
            _ip("-n", h.netns, "link", "set", h.ifname, "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")
        yield hosts
    finally:
        for h in hosts:
            # kill anything still running inside, then remove the namespace
            pids = subprocess.run(["ip", "netns", "pids", h.netns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", h.netns], capture_output=True)
