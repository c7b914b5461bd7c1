"""Challenge-response authentication on the shared token, in both directions.

The server (daemon or relay) opens every connection with a random nonce; the
client answers with HMAC-SHA256(token, nonce || hello-identity) and sends a
nonce of its own (``cnonce``). When the server holds a token, its accept
carries a proof: an HMAC over the client's nonce bound to this conversation
(the server's nonce, role, sender and ``last_seq``). So a client that holds a
token can tell the real server from a process that merely took its port.

The token itself never crosses the wire, a captured hello or accept cannot be
replayed against a fresh nonce, and the proof is keyed with a key derived from
the token for that purpose only, so a hello MAC can never pass as a proof (nor
the other way round), whatever bytes a server picks as its nonce.
"""

from __future__ import annotations

import hashlib
import hmac
import os

NONCE_BYTES = 16
# Names the derived key of the server's proof: a hello MAC is keyed with the token itself.
_PROOF_KEY_LABEL = b"traceml/accept-proof/v1"


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


def _field(value: bytes) -> bytes:
    # Length-prefixed, so no two different field lists serialise to the same bytes.
    return len(value).to_bytes(4, "big") + value


def accept_proof(token: str, cnonce: bytes, snonce: bytes, role: str, sender: str, last_seq: int) -> bytes:
    """The proof a server that holds ``token`` puts in its accept."""
    key = hmac.new(token.encode(), _PROOF_KEY_LABEL, hashlib.sha256).digest()
    msg = b"".join(_field(v) for v in (cnonce, snonce, role.encode(), sender.encode(), str(last_seq).encode()))
    return hmac.new(key, msg, hashlib.sha256).digest()


def verify_accept_proof(
    token: str, cnonce: bytes, snonce: bytes, role: str, sender: str, last_seq: int, proof: object
) -> bool:
    if not isinstance(proof, (bytes, bytearray)):
        return False
    return hmac.compare_digest(accept_proof(token, cnonce, snonce, role, sender, last_seq), bytes(proof))
