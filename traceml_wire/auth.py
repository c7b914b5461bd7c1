"""Challenge-response authentication on the shared token.

The daemon (or relay) opens every connection with a random nonce; the peer
answers with HMAC-SHA256(token, nonce || hello-identity). The token itself
never crosses the wire, and a captured hello cannot be replayed against a
fresh nonce.
"""

from __future__ import annotations

import hashlib
import hmac
import os

NONCE_BYTES = 16


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def hello_mac(token: str | None, nonce: bytes, role: str, sender: str) -> bytes:
    """The MAC a peer sends in its hello. An absent token MACs with an empty key,
    so open (tokenless) loopback setups use the same code path."""
    key = (token or "").encode()
    msg = nonce + b"\x00" + role.encode() + b"\x00" + sender.encode()
    return hmac.new(key, msg, hashlib.sha256).digest()


def verify_hello_mac(token: str | None, nonce: bytes, role: str, sender: str, mac: object) -> bool:
    if not isinstance(mac, (bytes, bytearray)):
        return False
    return hmac.compare_digest(hello_mac(token, nonce, role, sender), bytes(mac))
