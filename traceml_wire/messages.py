"""Message types, builders and validators (pure; no I/O).

Conversation on every connection (server = relay for agents, daemon for relays):

    server -> challenge {v, nonce}
    client -> hello     {v, role, sender, session, identity, mac[, cnonce]}
    server -> accept    {v, last_seq[, proof]}   or  refuse {reason} and close
    client -> batch ...  (numbered)        server -> ack {seq}
    client -> bye                           (clean end of stream)
    server -> control   {op, sender, steps, id}  (only to a client whose hello listed
                        "control" in ``caps``; see ``validate_control``)

A client of role ``control`` (``traceml-daemon profile --daemon``) sends no
batches: after its accept it sends ``request`` {op, rank, steps, id[, session]}
and the server says ``answer`` {id, status, message[, sender, session]}.

``cnonce`` (the client's own nonce) and ``proof`` (the server's HMAC over it,
see ``auth.accept_proof``) make the authentication mutual when a token is set;
both are optional, so peers without them still talk. The state machines that
say which message is legal when are ``traceml_wire.server_connection`` and
``traceml_wire.client_connection``.

Unknown fields are ignored everywhere (additive evolution). An unknown message
type is a ProtocolError for that peer only.

Two batch shapes travel:
  * ``batch`` (agent -> relay): ``seq`` and ``body``, the msgpack bytes of the
    rank's tables. The relay never unpacks ``body``.
  * ``rbatch`` (relay -> daemon): ``seq`` plus ``items``, a list of
    ``[sender, seq, body]`` forwarded verbatim, ``peers`` (sender -> identity
    of every sender in items, so each rbatch is self-contained for resend and
    spool), ``node`` (the relay's node identity), ``stats`` (the relay's
    cumulative drop counters), and two optional fields for spool files, which
    are replayed without a hello: ``sender`` (the relay's own sender id, as in
    its hello, so that spooled stats land under the live counter source) and
    ``spool_dropped_upto`` (the highest rbatch seq the relay's spool cap dropped:
    those rbatches may still sit on disk, but were counted as lost). The live
    daemon ignores both.
"""

from __future__ import annotations

from typing import Any

from traceml_wire.bounds import is_int64, seq_problem
from traceml_wire.errors import ProtocolError

# The identity fields a hello may carry, their types and bounds and their check are
# declared in traceml_wire/identity.py; re-exported for callers that say messages.*.
from traceml_wire.identity import IDENTITY_INT_FIELDS as IDENTITY_INT_FIELDS
from traceml_wire.identity import IDENTITY_STR_FIELDS as IDENTITY_STR_FIELDS
from traceml_wire.identity import CleanIdentity, clean_identity

PROTOCOL_VERSION = 1

CHALLENGE = "challenge"
HELLO = "hello"
ACCEPT = "accept"
REFUSE = "refuse"
BATCH = "batch"
RELAY_BATCH = "rbatch"
ACK = "ack"
BYE = "bye"

# A request down an open connection (daemon -> relay -> agent), e.g. "profile the next
# K steps of that rank". Sent only to a client whose hello's ``caps`` lists CAP_CONTROL:
# an older client, which would take an unknown type for a protocol error, never sees one.
CONTROL = "control"
CAP_CONTROL = "control"
KNOWN_CAPS = frozenset({CAP_CONTROL})
MAX_CAPS = 16  # entries of a hello's caps list read at most
OP_PROFILE = "profile"
CONTROL_OPS = frozenset({OP_PROFILE})
MAX_PROFILE_STEPS = 100  # steps one profile request may ask for
MAX_CONTROL_ID_CHARS = 64

REQUEST = "request"  # control client -> server
ANSWER = "answer"  # server -> control client
ANSWER_STATUSES = frozenset({"sent", "refused"})
MAX_ANSWER_CHARS = 1000

ROLE_AGENT = "agent"
ROLE_RELAY = "relay"
ROLE_CONTROL = "control"  # a one-shot requester (the CLI); only a daemon takes it
ROLES = frozenset({ROLE_AGENT, ROLE_RELAY, ROLE_CONTROL})

CLIENT_TYPES = frozenset({HELLO, BATCH, RELAY_BATCH, BYE, REQUEST})
SERVER_TYPES = frozenset({CHALLENGE, ACCEPT, REFUSE, ACK, ANSWER})


def challenge(nonce: bytes) -> dict[str, Any]:
    return {"t": CHALLENGE, "v": PROTOCOL_VERSION, "nonce": nonce}


def hello(
    *, role: str, sender: str, session: str, identity: dict[str, Any], mac: bytes, cnonce: bytes | None = None,
    caps: tuple[str, ...] = (),
) -> dict[str, Any]:
    message = {
        "t": HELLO,
        "v": PROTOCOL_VERSION,
        "role": role,
        "sender": sender,
        "session": session,
        "identity": identity,
        "mac": mac,
    }
    if cnonce is not None:
        message["cnonce"] = cnonce
    if caps:
        message["caps"] = list(caps)
    return message


def accept(last_seq: int = 0, proof: bytes | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"t": ACCEPT, "v": PROTOCOL_VERSION, "last_seq": last_seq}
    if proof is not None:
        message["proof"] = proof
    return message


def refuse(reason: str) -> dict[str, Any]:
    return {"t": REFUSE, "v": PROTOCOL_VERSION, "reason": reason}


def batch(seq: int, body: bytes) -> dict[str, Any]:
    return {"t": BATCH, "seq": seq, "body": body}


def relay_batch(
    seq: int,
    items: list[list[Any]],
    peers: dict[str, dict[str, Any]],
    node: dict[str, Any],
    stats: dict[str, int],
    sender: str | None = None,
    spool_dropped_upto: int = 0,
) -> dict[str, Any]:
    message = {"t": RELAY_BATCH, "seq": seq, "items": items, "peers": peers, "node": node, "stats": stats}
    if sender is not None:
        message["sender"] = sender
    if spool_dropped_upto:
        message["spool_dropped_upto"] = spool_dropped_upto
    return message


def ack(seq: int) -> dict[str, Any]:
    return {"t": ACK, "seq": seq}


def bye() -> dict[str, Any]:
    return {"t": BYE}


def request(op: str, rank: int, steps: int, request_id: str, session: str | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"t": REQUEST, "op": op, "rank": rank, "steps": steps, "id": request_id}
    if session is not None:
        message["session"] = session
    return message


def answer(request_id: str, status: str, text: str, sender: str | None = None,
           session: str | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"t": ANSWER, "id": request_id, "status": status, "message": text}
    if sender is not None:
        message["sender"] = sender
    if session is not None:
        message["session"] = session
    return message


def control(op: str, sender: str, steps: int, request_id: str) -> dict[str, Any]:
    """A request for the agent ``sender`` (relays pass it on to that agent's connection)."""
    return {"t": CONTROL, "op": op, "sender": sender, "steps": steps, "id": request_id}


# ---------------------------------------------------------------- validation


def _require(message: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = message.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise ProtocolError(f"{message.get('t')!r} message needs field {key!r} of type {_name(kind)}")
    return value


def _name(kind: type | tuple[type, ...]) -> str:
    if isinstance(kind, tuple):
        return "|".join(k.__name__ for k in kind)
    return kind.__name__


def _seq(message: dict[str, Any]) -> int:
    seq = _require(message, "seq", int)
    if seq_problem(seq) is not None:
        raise ProtocolError(f"sequence numbers run from 1 to 2**63-1, got {seq}")
    return seq


IdentityCache = dict[str, tuple[Any, CleanIdentity]]  # sender -> (identity as sent, cleaned)


def _cleaned(cache: IdentityCache | None, key: str, raw: object, max_entries: int) -> CleanIdentity:
    """``clean_identity(raw)``, reusing the result while ``key`` sends the same identity.

    A relay repeats every agent's identity in every rbatch; comparing it with the
    one sent last time costs a fraction of cleaning it again, and the same cleaned
    dict coming back lets the daemon's own per-sender caches match it by identity."""
    if cache is None:
        return clean_identity(raw)
    hit = cache.get(key)
    if hit is not None and (hit[0] is raw or hit[0] == raw):
        return hit[1]
    cleaned = clean_identity(raw)
    if len(cache) >= max_entries:
        cache.clear()  # bounded: a peer cycling through senders costs a re-clean, not memory
    cache[key] = (raw, cleaned)
    return cleaned


def validate_client_message(
    message: dict[str, Any], identities: IdentityCache | None = None, max_identities: int = 65_536
) -> dict[str, Any]:
    """Check a message a client sent; return it (with cleaned fields) or raise.

    ``identities`` (one per connection) caches cleaned rbatch peer and node identities."""
    kind = message["t"]
    if kind not in CLIENT_TYPES:
        raise ProtocolError(f"unknown message type {kind!r}")
    if kind == HELLO:
        version = _require(message, "v", int)
        if version != PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {version} not supported (this side speaks {PROTOCOL_VERSION})")
        role = _require(message, "role", str)
        if role not in ROLES:
            raise ProtocolError(f"unknown role {role!r}")
        sender = _require(message, "sender", str)
        if not sender or len(sender) > 200:
            raise ProtocolError("hello sender must be 1..200 characters")
        _require(message, "session", str)
        _require(message, "mac", bytes)
        cnonce = message.get("cnonce")
        if cnonce is not None and (not isinstance(cnonce, bytes) or not 8 <= len(cnonce) <= 64):
            raise ProtocolError("hello cnonce must be 8..64 bytes")
        message["identity"] = clean_identity(message.get("identity", {}))
        message["caps"] = clean_caps(message.get("caps"))
    elif kind == REQUEST:
        validate_request(message)
    elif kind == BATCH:
        _seq(message)
        _require(message, "body", bytes)
    elif kind == RELAY_BATCH:
        _seq(message)
        items = _require(message, "items", list)
        for item in items:
            if (
                not isinstance(item, list)
                or len(item) != 3
                or not isinstance(item[0], str)
                or not isinstance(item[1], int)
                or isinstance(item[1], bool)
                or item[1] < 1  # agent seqs start at 1, like every other seq
                or not isinstance(item[2], bytes)
            ):
                raise ProtocolError("rbatch items must be [sender:str, seq:int >= 1, body:bytes]")
        peers = _require(message, "peers", dict)
        for sender, identity in list(peers.items()):
            if type(sender) is not str:
                raise ProtocolError("rbatch peers must be keyed by sender string")
            peers[sender] = _cleaned(identities, sender, identity, max_identities)
        # "" is never a sender (hello requires 1..200 characters): the node's slot.
        message["node"] = _cleaned(identities, "", message.get("node", {}), max_identities)
        stats = message.get("stats", {})
        message["stats"] = {
            k: v for k, v in stats.items() if isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
        } if isinstance(stats, dict) else {}
        # Optional (older relays and spools lack it); like hello's, 1..200 characters.
        sender = message.get("sender")
        message["sender"] = sender if isinstance(sender, str) and 0 < len(sender) <= 200 else None
        upto = message.get("spool_dropped_upto")
        message["spool_dropped_upto"] = upto if is_int64(upto) and upto > 0 else 0
    return message


def validate_server_message(message: dict[str, Any]) -> dict[str, Any]:
    kind = message["t"]
    if kind not in SERVER_TYPES:
        raise ProtocolError(f"unknown message type {kind!r}")
    if kind == CHALLENGE:
        nonce = _require(message, "nonce", bytes)
        if len(nonce) < 8:
            raise ProtocolError("challenge nonce too short")
    elif kind == ACCEPT:
        last = message.get("last_seq", 0)
        message["last_seq"] = last if is_int64(last) and last >= 0 else 0
        if "proof" in message and not isinstance(message["proof"], bytes):
            del message["proof"]  # a malformed proof counts as none (the client then refuses to trust it)
    elif kind == REFUSE:
        reason = message.get("reason")
        message["reason"] = reason if isinstance(reason, str) else "refused"
    elif kind == ACK:
        _seq(message)
    elif kind == ANSWER:
        _control_id(message.get("id"))
        status = message.get("status")
        if type(status) is not str or status not in ANSWER_STATUSES:
            raise ProtocolError(f"answer status must be one of {sorted(ANSWER_STATUSES)}")
        text = message.get("message")
        message["message"] = text[:MAX_ANSWER_CHARS] if isinstance(text, str) else ""
        for key, cap in (("sender", 200), ("session", 256)):
            value = message.get(key)
            message[key] = value[:cap] if isinstance(value, str) else None
    return message


def clean_caps(raw: object) -> frozenset[str]:
    """The known capabilities a hello lists; anything else (a non-list, unknown names,
    entries past MAX_CAPS) reads as not stated: an optional field never fails a hello."""
    if not isinstance(raw, list):
        return frozenset()
    return frozenset(c for c in raw[:MAX_CAPS] if type(c) is str and c in KNOWN_CAPS)


def validate_control(message: dict[str, Any]) -> dict[str, Any]:
    """Check a control message (either hop); return it cleaned or raise ProtocolError.

    Every field is bounded: a known op, a sender as in a hello (1..200 characters),
    1..MAX_PROFILE_STEPS steps, a printable id of 1..MAX_CONTROL_ID_CHARS characters."""
    op = message.get("op")
    if type(op) is not str or op not in CONTROL_OPS:
        raise ProtocolError(f"control op must be one of {sorted(CONTROL_OPS)}")
    sender = message.get("sender")
    if type(sender) is not str or not 0 < len(sender) <= 200:
        raise ProtocolError("control sender must be 1..200 characters")
    steps = message.get("steps")
    if type(steps) is not int or not 1 <= steps <= MAX_PROFILE_STEPS:
        raise ProtocolError(f"control steps must be an int from 1 to {MAX_PROFILE_STEPS}")
    request_id = _control_id(message.get("id"))
    return {"t": CONTROL, "op": op, "sender": sender, "steps": steps, "id": request_id}


def _control_id(request_id: object) -> str:
    if (
        type(request_id) is not str
        or not 0 < len(request_id) <= MAX_CONTROL_ID_CHARS
        or not request_id.isascii()
        or not request_id.isprintable()
    ):
        raise ProtocolError(f"control id must be 1..{MAX_CONTROL_ID_CHARS} printable ASCII characters")
    return request_id


def validate_request(message: dict[str, Any]) -> dict[str, Any]:
    """A control client's request: a known op, a rank from 0, 1..MAX_PROFILE_STEPS steps,
    an id as a control's, an optional session of 1..256 characters. Raises ProtocolError."""
    op = message.get("op")
    if type(op) is not str or op not in CONTROL_OPS:
        raise ProtocolError(f"request op must be one of {sorted(CONTROL_OPS)}")
    rank, steps, session = message.get("rank"), message.get("steps"), message.get("session")
    if type(rank) is not int or not 0 <= rank < 2**31:
        raise ProtocolError("request rank must be an int from 0")
    if type(steps) is not int or not 1 <= steps <= MAX_PROFILE_STEPS:
        raise ProtocolError(f"request steps must be an int from 1 to {MAX_PROFILE_STEPS}")
    if session is not None and (type(session) is not str or not 0 < len(session) <= 256):
        raise ProtocolError("request session must be 1..256 characters")
    _control_id(message.get("id"))
    return message
