"""A fuzzer that speaks the TraceML wire protocol to the real daemon (and relay).

Generator: one function per attack kind, registered in ``KINDS``. Each turns a
seeded ``random.Random`` into a ``Script``: pure data (which server, the hello
to send, the frames that follow), so a seed replays the same attack bytes; only
the hello's MAC is computed at send time, over the server's fresh nonce.

Driver: ``run_fuzz`` starts ``python -m traceml_daemon serve`` (and, with
``with_relay``, ``python -m relay`` in front of it), runs good peers whose every
step row is known (and, optionally, a real ``torchrun`` job traced by the agent),
runs attacker threads executing scripts for ``duration_s``, stops everything
cleanly and reads the SQLite file. ``FuzzReport.problems`` names every broken
invariant: a server exited, a good step not stored exactly once with its exact
values, a good peer refused or cut off, peak RSS over the cap.

Only sockets, msgpack and ``traceml_wire.framing``/``messages``/``auth``/``tables``
are used on the wire: the product's own client classes are being rewritten, the
wire bytes are not.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import random
import re
import selectors
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from tests.support.procs import base_env, free_port
from traceml_wire import auth, messages
from traceml_wire.body import encode_body
from traceml_wire.errors import ProtocolError
from traceml_wire.framing import (
    DEFAULT_MAX_FRAME_BYTES,
    HEADER_BYTES,
    MAX_AGENT_FRAME_BYTES,
    MAX_HELLO_FRAME_BYTES,
    FrameDecoder,
    encode_frame,
    unpack_message,
)
from traceml_wire.partials import METRICS, PARTIAL_COLUMNS
from traceml_wire.tables import INT, REAL, TABLES, TEXT, columns

REPO = Path(__file__).resolve().parents[2]

# ------------------------------------------------------------------ hostile values

# Every integer position gets these. -2**63-1 has no msgpack encoding (its ints stop at
# -2**63), so ``wire_int`` sends it as the float it rounds to: a wrong type instead.
BOUNDARY_INTS: tuple[int, ...] = (0, -1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, -(2**63) - 1)
_INT_NAMES = {
    0: "0", -1: "-1", 2**31: "2**31", 2**53 + 1: "2**53+1", 2**63 - 1: "2**63-1", 2**63: "2**63",
    2**64 - 1: "2**64-1", -(2**63) - 1: "-2**63-1", -(2**63): "-2**63",
}
NONFINITE: tuple[float, ...] = (math.nan, math.inf, -math.inf)
# Terminal escapes, Rich markup, log-line forgery, NUL, bidi override, SQL, format strings.
ODD_STRINGS: tuple[str, ...] = (
    "\x1b[31mred\x1b[0m",
    "\x1b[2J\x1b[H\x1b]0;pwned\x07",
    "[/]",
    "[bold]",
    "[bold red]x[/bold red][/]",
    "[link=https://example.invalid]y[/link]",
    "\x00nul\x00",
    "line\n2030-01-01 CRITICAL forged log line",
    "\r\x1b[1A\x1b[K",
    "\u202eevil\u202c",
    "\x07\x08\x7f\x9b31m",
    "%s%s%n%(x)s",
    "{0}{1}{__class__}",
    "'; DROP TABLE steps; --",
    "\ud7ff\ue000\U0010ffff",
    "a" * 200,
)
HUGE_STRING_CHARS = 8_000_000  # "8 MB sender ids": two of them (item and peers key) still fit 16 MiB
MANY_SENDERS = 20_000
MANY_KEYS = 50_000
RELAY_COUNTERS = (
    "dropped_batches", "dropped_bytes", "spooled_batches", "spool_dropped_batches", "agents_connected",
    "refused_agents", "agent_protocol_errors", "received_batches", "duplicate_batches", "rbatches_sent",
    "rbatches_acked", "upstream_connects",
)
_MSGPACK_INT_MIN = -(2**63)
_MSGPACK_INT_MAX = 2**64 - 1


def int_name(value: int) -> str:
    return _INT_NAMES.get(value, str(value))


def wire_int(value: int) -> int | float:
    """``value`` as msgpack can carry it: ints outside its range travel as floats."""
    return value if _MSGPACK_INT_MIN <= value <= _MSGPACK_INT_MAX else float(value)


class Raw:
    """Packed msgpack bytes spliced verbatim where a value goes: what msgpack-python
    will not produce itself (nesting past its limit, invalid UTF-8 in a str)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def raw_str(data: bytes) -> Raw:
    """A msgpack *str* whose bytes are ``data`` (invalid UTF-8 where a string goes)."""
    n = len(data)
    if n < 32:
        head = bytes([0xA0 | n])
    elif n < 256:
        head = b"\xd9" + bytes([n])
    elif n < 65536:
        head = b"\xda" + n.to_bytes(2, "big")
    else:
        head = b"\xdb" + n.to_bytes(4, "big")
    return Raw(head + data)


def nested(depth: int, kind: str = "array") -> Raw:
    """``depth`` levels of one-element arrays (or maps) around a nil."""
    unit = b"\x91" if kind == "array" else b"\x81\xa1k"
    return Raw(unit * depth + b"\xc0")


INVALID_UTF8: tuple[bytes, ...] = (b"\xff\xfe", b"abc\xc3", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf8\x88\x80\x80\x80")


def pack(value: Any) -> bytes:
    """msgpack ``value`` (bin type for bytes), splicing every ``Raw`` in verbatim."""
    tokens: list[tuple[bytes, bytes]] = []

    def swap(v: Any) -> Any:
        if isinstance(v, Raw):
            token = f"\x00\x01raw-splice-{len(tokens)}\x01\x00"
            tokens.append((msgpack.packb(token, use_bin_type=True), v.data))
            return token
        if isinstance(v, dict):
            return {swap(k): swap(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [swap(x) for x in v]
        return v

    out = msgpack.packb(swap(value), use_bin_type=True)
    for token, data in tokens:
        at = out.find(token)
        out = out[:at] + data + out[at + len(token) :]
    return out


# ------------------------------------------------------------------ scripts


class _GoodMac:
    """Stands for the right MAC in a hello template (computed over the server's nonce)."""

    def __repr__(self) -> str:
        return "GOOD_MAC"


GOOD_MAC = _GoodMac()


@dataclass(frozen=True)
class Send:
    """One frame: ``payload`` is its msgpack body (the header is added on the wire)."""

    payload: bytes
    variant: str  # what this message tries, for the report
    seq: int | None = None  # the ack that counts as "acked" (None: any ack)


@dataclass(frozen=True)
class SendRaw:
    """Bytes as they go on the wire, headers included (truncated and oversize frames)."""

    data: bytes
    variant: str
    # "hang_up": half-close, then wait for the server to close; "wait": wait for its answer;
    # "park": leave the connection open, silent, until the run ends (what the server does is recorded then).
    then: str = "hang_up"


@dataclass(frozen=True)
class Park:
    """Keep the connection open until the run ends (or the server closes it)."""

    variant: str
    trickle: bytes = b""  # sent one byte per second (slow hello); b"": silent


Step = Send | SendRaw | Park


@dataclass(frozen=True)
class Script:
    kind: str
    endpoint: str  # "daemon" or "relay"
    hello: dict[str, Any] | None  # None: speak without a hello; "mac": GOOD_MAC filled in at send time
    steps: tuple[Step, ...]
    hello_variant: str = "valid hello"
    connections: int = 1  # a Park-only script may open many (idle sockets)
    max_parked: int = 3000  # this kind's connections held at once: no new one while that many are parked

    def fingerprint(self) -> bytes:
        """The script's bytes, for determinism checks."""
        hello = pack({k: (repr(v) if v is GOOD_MAC else v) for k, v in self.hello.items()}) if self.hello else b""
        parts = [self.kind.encode(), self.endpoint.encode(), hello, self.hello_variant.encode(), str(self.connections).encode()]
        for step in self.steps:
            if isinstance(step, Send):
                parts += [b"S", step.payload, step.variant.encode(), str(step.seq).encode()]
            elif isinstance(step, SendRaw):
                parts += [b"R", step.data, step.variant.encode(), step.then.encode()]
            else:
                parts += [b"P", step.trickle, step.variant.encode()]
        return b"\x1f".join(parts)


@dataclass(frozen=True)
class Env:
    """What a generator may know about the run."""

    relay: bool  # a relay runs: agent-role attacks may go through it
    index: int  # the script's number in the run (unique attacker names)


Generator = Callable[[random.Random, Env], Script]


# ------------------------------------------------------------------ builders


def hello_template(role: str, sender: Any, session: Any, identity: Any, **extra: Any) -> dict[str, Any]:
    message = messages.hello(role=role, sender="x", session="x", identity={}, mac=b"")
    message.update(sender=sender, session=session, identity=identity, mac=GOOD_MAC, **extra)
    return message


def _names(kind: str, env: Env, rng: random.Random) -> tuple[str, str, str]:
    """(session, relay sender, agent sender prefix) of one attacker: never a good peer's."""
    tag = f"{env.index}-{rng.getrandbits(24):06x}"
    session = f"fuzz-{kind}"
    return session, f"relay/{session}/n9/{tag}", f"{session}/a0/n9/{tag}"


def _identity(rank: int, session: str) -> dict[str, Any]:
    return {"session": session, "attempt": 0, "global_rank": rank, "local_rank": rank % 8, "node_rank": 9,
            "world_size": 64, "local_world_size": 8, "nnodes": 8, "hostname": "fuzz-host", "pid": 4000 + rank,
            "parallelism": "ddp", "device": "cpu"}


NODE = {"node_rank": 9, "hostname": "fuzz-host"}


def _cell(kind: str, rng: random.Random, row: int) -> Any:
    if kind == INT:
        return rng.randrange(0, 10**9)
    if kind == REAL:
        return 1_700_000_000.0 + row + rng.random()
    return rng.choice(("idle", "forward", "loss", "x"))


def valid_table(table: str, n: int, rng: random.Random, first_step: int = 0) -> dict[str, list[Any]]:
    """``n`` well-formed rows of ``table`` (steps numbered from ``first_step``)."""
    cols: dict[str, list[Any]] = {}
    for name, kind in TABLES[table]:
        if name == "step":
            cols[name] = list(range(first_step, first_step + n))
        else:
            cols[name] = [_cell(kind, rng, i) for i in range(n)]
    return cols


def small_body(rng: random.Random, first_step: int = 0, n: int = 3) -> bytes:
    return encode_body({"steps": valid_table("steps", n, rng, first_step)}, sent_ts=1_700_000_000.0)


def body_of(tables: Any, **extra: Any) -> bytes:
    """A body as sent, with no history partials of its own (``pack`` splices Raw values)."""
    return pack({"tables": tables, **extra})


def body_with_partials(tables: dict[str, dict[str, list[Any]]], **extra: Any) -> bytes:
    """The agent's own encoding (partials where there are >= 64 steps); the plain body
    where the partials' sums leave what msgpack can carry."""
    try:
        return encode_body(tables, **extra)
    except (OverflowError, ValueError, TypeError):
        return body_of(tables, **extra)


def _paths(env: Env) -> list[str]:
    """Ways a body reaches the daemon: an agent through the relay or directly, a relay's rbatch."""
    return ["agent->daemon", "relay->daemon"] + (["agent->relay"] if env.relay else [])


def content_script(kind: str, rng: random.Random, env: Env, bodies: Sequence[tuple[str, bytes]],
                   path: str | None = None) -> Script:
    """Carry hostile batch bodies in a well-formed envelope, one message per body."""
    path = path or rng.choice(_paths(env))
    session, relay_sender, agent = _names(kind, env, rng)
    sender = f"{agent}/r{env.index % 997}"
    identity = _identity(env.index % 997, session)
    steps: list[Step] = []
    if path == "relay->daemon":
        hello = hello_template(messages.ROLE_RELAY, relay_sender, session, dict(NODE))
        for seq, (variant, body) in enumerate(bodies, 1):
            message = messages.relay_batch(seq, [[sender, seq, body]], {sender: identity}, dict(NODE), {})
            steps.append(Send(pack(message), f"{path}: {variant}", seq))
        return Script(kind, "daemon", hello, tuple(steps))
    hello = hello_template(messages.ROLE_AGENT, sender, session, identity)
    for seq, (variant, body) in enumerate(bodies, 1):
        steps.append(Send(pack(messages.batch(seq, body)), f"{path}: {variant}", seq))
    return Script(kind, "relay" if path == "agent->relay" else "daemon", hello, tuple(steps))


def relay_script(kind: str, rng: random.Random, env: Env, frames: Sequence[tuple[str, Any, int | None]]) -> Script:
    """An authenticated relay (to the daemon) sending ``frames``: (variant, message, seq)."""
    session, relay_sender, _ = _names(kind, env, rng)
    hello = hello_template(messages.ROLE_RELAY, relay_sender, session, dict(NODE))
    steps = tuple(Send(m if isinstance(m, bytes) else pack(m), v, seq) for v, m, seq in frames)
    return Script(kind, "daemon", hello, steps)


def _endpoint(rng: random.Random, env: Env) -> str:
    return rng.choice(["daemon", "relay"]) if env.relay else "daemon"


def _role_for(endpoint: str, rng: random.Random) -> str:
    return messages.ROLE_AGENT if endpoint == "relay" else rng.choice([messages.ROLE_AGENT, messages.ROLE_RELAY])


def _valid_hello(kind: str, endpoint: str, rng: random.Random, env: Env) -> dict[str, Any]:
    session, relay_sender, agent = _names(kind, env, rng)
    role = _role_for(endpoint, rng)
    if role == messages.ROLE_RELAY:
        return hello_template(role, relay_sender, session, dict(NODE))
    return hello_template(role, f"{agent}/r0", session, _identity(0, session))


def _frame_cap(endpoint: str) -> int:
    return MAX_AGENT_FRAME_BYTES if endpoint == "relay" else DEFAULT_MAX_FRAME_BYTES


# ------------------------------------------------------------------ attack kinds
# One function per kind; each returns one Script. Registered in KINDS at the bottom.


def idle_unauthenticated(rng: random.Random, env: Env) -> Script:
    """Connect and say nothing: up to 1100 sockets at once, past every connection cap."""
    n = rng.choice([16, 128, 512, 1100])
    endpoint = _endpoint(rng, env)
    return Script("idle_unauthenticated", endpoint, None, (Park(f"{n} silent sockets"),), connections=n)


def slow_hello(rng: random.Random, env: Env) -> Script:
    """A hello trickled one byte per second (slowloris): the hello timeout must end it."""
    endpoint = _endpoint(rng, env)
    hello = _valid_hello("slow_hello", endpoint, rng, env)
    hello["mac"] = b"\x00" * 32
    data = encode_frame(pack(hello))
    n = rng.choice([1, 4, 16])
    return Script("slow_hello", endpoint, None, (Park(f"{n} trickled hellos", trickle=data),), connections=n)


def oversize_header(rng: random.Random, env: Env) -> Script:
    """A header declaring more than the cap, alone: refused before the body is read."""
    endpoint = _endpoint(rng, env)
    authenticated = rng.random() < 0.5
    cap = _frame_cap(endpoint) if authenticated else MAX_HELLO_FRAME_BYTES
    declared = rng.choice([cap + 1, DEFAULT_MAX_FRAME_BYTES + 1, 2**31, 2**32 - 1])
    step = SendRaw(declared.to_bytes(HEADER_BYTES, "big"), f"header declaring {declared} bytes "
                   f"({'after' if authenticated else 'before'} hello)", then="wait")
    hello = _valid_hello("oversize_header", endpoint, rng, env) if authenticated else None
    return Script("oversize_header", endpoint, hello, (step,))


def truncated_frames(rng: random.Random, env: Env) -> Script:
    """Frames cut short: a header then half its body, a partial header, a cut msgpack body."""
    endpoint = _endpoint(rng, env)
    authenticated = rng.random() < 0.6
    hello = _valid_hello("truncated_frames", endpoint, rng, env) if authenticated else None
    batch = pack(messages.batch(1, small_body(rng)))
    variant = rng.choice(["half body", "partial header", "cut msgpack"])
    if variant == "half body":
        data = encode_frame(batch)[: HEADER_BYTES + len(batch) // 2]
    elif variant == "partial header":
        data = encode_frame(batch)[: rng.randrange(1, HEADER_BYTES)]
    else:
        data = encode_frame(batch[: len(batch) - rng.randrange(1, 8)])
    where = "after" if authenticated else "before"
    return Script("truncated_frames", endpoint, hello, (SendRaw(data, f"{variant} ({where} hello), then hang up"),))


def garbage_frames(rng: random.Random, env: Env) -> Script:
    """Well-framed bodies that are not protocol messages."""
    endpoint = _endpoint(rng, env)
    authenticated = rng.random() < 0.6
    hello = _valid_hello("garbage_frames", endpoint, rng, env) if authenticated else None
    choices: list[tuple[str, bytes]] = [
        ("random bytes", rng.randbytes(rng.randrange(1, 4096))),
        ("empty body", b""),
        ("top-level array", pack([1, 2, 3])),
        ("top-level int", pack(2**64 - 1)),
        ("top-level nil", pack(None)),
        ("top-level str", pack("hello")),
        ("map without t", pack({"seq": 1})),
        ("t is an int", pack({"t": 7})),
        ("t is bytes", pack({"t": b"batch"})),
        ("msgpack ext type", b"\xd4\x01\x00"),
        ("trailing bytes after the map", pack({"t": "bye"}) + b"\x00\x00"),
        ("map with 2**32-1 declared entries", b"\xdf\xff\xff\xff\xff"),
        ("str declaring 2**32-1 bytes", b"\xdb\xff\xff\xff\xff"),
    ]
    picks = rng.sample(choices, 3)
    where = "after" if authenticated else "before"
    return Script("garbage_frames", endpoint, hello, tuple(Send(b, f"{v} ({where} hello)") for v, b in picks))


def bad_hello(rng: random.Random, env: Env) -> Script:
    """The hello itself: wrong types, boundary ints, odd and oversized strings, bad MACs."""
    endpoint = _endpoint(rng, env)
    hello = _valid_hello("bad_hello", endpoint, rng, env)
    field_name = rng.choice(["v", "role", "sender", "session", "identity", "mac", "extra", "missing"])
    variant: str
    if field_name == "v":
        value: Any = rng.choice([*map(wire_int, BOUNDARY_INTS), "1", 1.0, None, 2, True])
        hello["v"], variant = value, f"v={value!r}"
    elif field_name == "role":
        value = rng.choice(["admin", "", 5, b"agent", raw_str(INVALID_UTF8[0]), "\x1b[31m", "relay" if endpoint == "relay" else "daemon"])
        hello["role"], variant = value, f"role={_short(value)}"
    elif field_name == "sender":
        value = rng.choice(["", "s" * 201, "s" * 60_000, *ODD_STRINGS[:6], b"sender", raw_str(b"r/\xff\xfe"), 7, None])
        hello["sender"], variant = value, f"sender={_short(value)}"
    elif field_name == "session":
        value = rng.choice(["x" * 60_000, *ODD_STRINGS[:6], b"s", raw_str(b"\xc0\xaf"), 2**63, None, ["s"]])
        hello["session"], variant = value, f"session={_short(value)}"
    elif field_name == "identity":
        name = rng.choice(messages.IDENTITY_INT_FIELDS)
        boundary, nonfinite, odd = wire_int(rng.choice(BOUNDARY_INTS)), rng.choice(NONFINITE), rng.choice(ODD_STRINGS)
        depth = rng.choice([100, 900, 2000])
        label, value = rng.choice([
            (f"{name}={_short(boundary)}", {name: boundary}),
            (f"{name}={nonfinite!r}", {name: nonfinite}),
            (f"{name}='0'", {name: "0"}),
            (f"hostname={odd!r}, device=invalid UTF-8", {"hostname": odd, "device": raw_str(b"\xff")}),
            ("4000 unknown keys", {f"k{i}": i for i in range(4000)}),
            (f"hostname nested {depth} deep", {"hostname": nested(depth)}),
            ("a map nested 50 deep", nested(50, "map")),
            ("a list", [1, 2]),
            ("a str", "identity"),
            ("nil", None),
        ])
        hello["identity"], variant = value, f"identity {label}"
    elif field_name == "mac":
        value = rng.choice([b"\x00" * 32, "mac", b"", b"\x01" * 60_000, None, 0])
        hello["mac"], variant = value, f"mac={_short(value)}"
    elif field_name == "extra":
        value = rng.choice([nested(900), {f"u{i}": i for i in range(3000)}, raw_str(b"\xff"), math.nan])
        hello["zz_unknown"], variant = value, f"unknown field={_short(value)}"
    else:
        gone = rng.choice(["v", "role", "sender", "session", "identity", "mac", "t"])
        del hello[gone]
        variant = f"missing {gone}"
    # If the server takes it, one batch follows, so what it accepted is stored somewhere.
    role, sender = hello.get("role"), hello.get("sender")
    follow: tuple[Step, ...] = ()
    if role == messages.ROLE_RELAY and isinstance(sender, str):
        agent = f"fuzz-bad_hello/a0/n9/{env.index}/r1"
        follow = (Send(pack(messages.relay_batch(1, [[agent, 1, small_body(rng)]], {agent: _identity(1, "fuzz-bad_hello")},
                                                 dict(NODE), {})), "rbatch after the hello", 1),)
    elif role == messages.ROLE_AGENT:
        follow = (Send(pack(messages.batch(1, small_body(rng))), "batch after the hello", 1),)
    return Script("bad_hello", endpoint, hello, follow, hello_variant=variant)


def wrong_message_types(rng: random.Random, env: Env) -> Script:
    """After a good hello: unknown types, a second hello, the other role's batch, wrong field types."""
    endpoint = _endpoint(rng, env)
    hello = _valid_hello("wrong_message_types", endpoint, rng, env)
    role = hello["role"]
    body = small_body(rng)
    agent = f"fuzz-wrong_message_types/a0/n9/{env.index}/r2"
    good_rbatch = messages.relay_batch(1, [[agent, 1, body]], {agent: _identity(2, "fuzz")}, dict(NODE), {})
    choices: list[tuple[str, Any]] = [
        ("unknown type", {"t": "mystery"}),
        ("second hello", {**hello, "mac": b"\x00" * 32}),
        ("ack from a client", messages.ack(1)),
        ("challenge from a client", messages.challenge(b"\x00" * 16)),
        ("accept from a client", messages.accept(0)),
        ("rbatch from an agent" if role == messages.ROLE_AGENT else "batch from a relay",
         good_rbatch if role == messages.ROLE_AGENT else messages.batch(1, body)),
        ("bye then a batch", None),
    ]
    for seq in ("1", 1.5, None, True, [1], {"s": 1}, b"\x01"):
        msg = dict(good_rbatch) if role == messages.ROLE_RELAY else messages.batch(1, body)
        msg["seq"] = seq
        choices.append((f"seq={seq!r}", msg))
    if role == messages.ROLE_RELAY:
        for field_name, value in (
            ("items", {"a": 1}), ("items", "items"), ("items", [[agent, 1]]), ("items", [[agent, 1, body, 4]]),
            ("items", [[7, 1, body]]), ("items", [[b"s", 1, body]]), ("items", [[None, 1, body]]),
            ("items", [[agent, "1", body]]), ("items", [[agent, 1.0, body]]), ("items", [[agent, True, body]]),
            ("items", [[agent, 1, "body"]]), ("items", [[agent, 1, 5]]), ("items", [agent, 1, body]),
            ("peers", [1, 2]), ("peers", "peers"), ("peers", {5: {}}), ("peers", {agent: [1]}),
            ("node", [1]), ("node", 5), ("node", "n"), ("stats", [1]), ("stats", "s"), ("stats", 5),
            ("sender", 5), ("spool_dropped_upto", "x"),
        ):
            msg = dict(good_rbatch)
            msg[field_name] = value
            choices.append((f"{field_name}={_short(value)}", msg))
    else:
        for value in ("body", 5, None, [1], {"tables": {}}):
            choices.append((f"body={_short(value)}", {"t": messages.BATCH, "seq": 1, "body": value}))
    picks = rng.sample(choices, 3)
    steps: list[Step] = []
    for variant, msg in picks:
        if msg is None:
            steps.append(Send(pack(messages.bye()), "bye"))
            steps.append(Send(pack(messages.batch(1, body) if role == messages.ROLE_AGENT else good_rbatch),
                              "batch after bye", 1))
        else:
            steps.append(Send(pack(msg), variant))
    return Script("wrong_message_types", endpoint, hello, tuple(steps))


def seq_boundaries(rng: random.Random, env: Env) -> Script:
    """Boundary ints as batch, rbatch and item seqs, between well-formed ones."""
    values = rng.sample(BOUNDARY_INTS, 3)
    path = rng.choice(_paths(env))
    if path == "relay->daemon":
        session, relay_sender, agent = _names("seq_boundaries", env, rng)
        sender = f"{agent}/r3"
        frames: list[tuple[str, Any, int | None]] = []
        rseq = 0
        for value in values:
            rseq += 1
            where = rng.choice(["rbatch", "item"])
            wseq, iseq = (wire_int(value), rseq) if where == "rbatch" else (rseq, wire_int(value))
            msg = messages.relay_batch(0, [[sender, iseq, small_body(rng, rseq * 10)]], {sender: _identity(3, session)},
                                       dict(NODE), {})
            msg["seq"] = wseq
            frames.append((f"{path}: {where} seq={int_name(value)}", msg, value if where == "rbatch" else rseq))
        return relay_script("seq_boundaries", rng, env, frames)
    session, _, agent = _names("seq_boundaries", env, rng)
    hello = hello_template(messages.ROLE_AGENT, f"{agent}/r3", session, _identity(3, session))
    steps: list[Step] = [Send(pack(messages.batch(1, small_body(rng))), f"{path}: batch seq=1", 1)]
    for value in values:
        msg = messages.batch(1, small_body(rng, 100))
        msg["seq"] = wire_int(value)
        steps.append(Send(pack(msg), f"{path}: batch seq={int_name(value)}", value))
    return Script("seq_boundaries", "relay" if path == "agent->relay" else "daemon", hello, tuple(steps))


def seq_jump_other_sender(rng: random.Random, env: Env) -> Script:
    """One sender's seq jumps to 2**63-1 (then past it) while another's goes on normally."""
    path = rng.choice(_paths(env))
    if path == "relay->daemon":
        session, _, agent = _names("seq_jump_other_sender", env, rng)
        a, b = f"{agent}/r4", f"{agent}/r5"
        peers = {a: _identity(4, session), b: _identity(5, session)}
        plan = [(1, 1), (2, 2**63 - 1), (3, 2**63), (4, 2**64 - 1), (5, 2**63 - 1)]
        frames = [
            (f"{path}: sender B seq {int_name(bseq)} beside sender A seq {aseq}",
             messages.relay_batch(aseq, [[a, aseq, small_body(rng, aseq * 10)], [b, bseq, small_body(rng, aseq * 10)]],
                                  peers, dict(NODE), {}), aseq)
            for aseq, bseq in plan
        ]
        return relay_script("seq_jump_other_sender", rng, env, frames)
    session, _, agent = _names("seq_jump_other_sender", env, rng)
    hello = hello_template(messages.ROLE_AGENT, f"{agent}/r6", session, _identity(6, session))
    steps = tuple(Send(pack(messages.batch(seq, small_body(rng, i * 10))), f"{path}: batch seq {int_name(seq)}", seq)
                  for i, seq in enumerate((1, 2**63 - 1, 2**63, 2**64 - 1)))
    return Script("seq_jump_other_sender", "relay" if path == "agent->relay" else "daemon", hello, steps)


def stall_max_header(rng: random.Random, env: Env) -> Script:
    """Headers declaring up to the full frame cap, a little of each body, then silence until
    the run ends: two or more at once, so their declared sizes add up to the daemon's inbound
    budget (32 MiB) if it reserves them up front."""
    endpoint = _endpoint(rng, env)
    if rng.random() < 0.2:
        data = MAX_HELLO_FRAME_BYTES.to_bytes(HEADER_BYTES, "big") + rng.randbytes(rng.choice([0, 1, 4096]))
        step = SendRaw(data, f"header declaring {MAX_HELLO_FRAME_BYTES} bytes, then stall (before hello)", then="park")
        return Script("stall_max_header", endpoint, None, (step,), max_parked=8)
    cap = _frame_cap(endpoint)
    sizes = [rng.choice([cap, cap - HEADER_BYTES]) for _ in range(2)]
    sizes += [rng.choice([cap // 2 - HEADER_BYTES, cap // 4 - HEADER_BYTES, 1 << 20]) for _ in range(rng.randrange(3))]
    steps: list[Step] = []
    for declared in sizes:
        sent = rng.choice([0, 1, 4096, 65536])
        data = declared.to_bytes(HEADER_BYTES, "big") + rng.randbytes(sent)
        steps.append(SendRaw(data, f"header declaring {declared} bytes, {sent} sent, then stall (after hello)",
                             then="park"))
    # Each on a connection of its own (a parked step ends its connection; the next one says hello again).
    # A handful, held to the end of the run, is the attack; thousands would only repeat
    # idle_unauthenticated's lockout by connection count.
    return Script("stall_max_header", endpoint, _valid_hello("stall_max_header", endpoint, rng, env), tuple(steps),
                  max_parked=8)


def _boundary_bodies(rng: random.Random, values: Sequence[Any], kinds: tuple[str, ...], label: Callable[[Any], str],
                     count: int = 4) -> list[tuple[str, bytes]]:
    bodies: list[tuple[str, bytes]] = []
    for _ in range(count):
        table = rng.choice([t for t in TABLES if any(k in kinds for _, k in TABLES[t])])
        target = rng.choice([c for c, k in TABLES[table] if k in kinds])
        value = rng.choice(values)
        n = rng.choice([1, 3, 64])
        cols = valid_table(table, n, rng, first_step=rng.randrange(0, 10**6))
        where = rng.choice(["one cell", "every cell"])
        if where == "one cell":
            cols[target][rng.randrange(n)] = value
        else:
            cols[target] = [value] * n
        bodies.append((f"{table}.{target}={label(value)} in {where} of {n}", body_with_partials({table: cols})))
    return bodies


def int_boundaries(rng: random.Random, env: Env) -> Script:
    """Boundary ints in the int and real cells of every table."""
    values = [wire_int(v) for v in BOUNDARY_INTS]
    bodies = _boundary_bodies(rng, values, (INT, REAL), lambda v: int_name(v) if isinstance(v, int) else repr(v))
    return content_script("int_boundaries", rng, env, bodies)


def nonfinite_floats(rng: random.Random, env: Env) -> Script:
    """nan, inf and -inf in real cells (and, as a wrong type, in int cells), scalars and sent_ts."""
    bodies = _boundary_bodies(rng, NONFINITE, (REAL,), repr, count=3)
    value = rng.choice(NONFINITE)
    pick = rng.choice(["scalar", "int cell", "sent_ts", "steps ts"])
    if pick == "scalar":
        cols = {"step": [1, 2], "name": ["loss", "loss"], "value": [value, value]}
        bodies.append((f"scalars.value={value!r}", body_of({"scalars": cols})))
    elif pick == "int cell":
        cols = valid_table("steps", 3, rng)
        cols["step_ns"][0] = value
        bodies.append((f"steps.step_ns={value!r} (int column)", body_of({"steps": cols})))
    elif pick == "sent_ts":
        bodies.append((f"sent_ts={value!r}", body_of({"steps": valid_table("steps", 3, rng)}, sent_ts=value)))
    else:
        cols = valid_table("steps", 70, rng)
        cols["ts"] = [value] * 70
        bodies.append((f"steps.ts={value!r} in 70 rows (history last_ts)", body_with_partials({"steps": cols})))
    return content_script("nonfinite_floats", rng, env, bodies)


def _bucket_steps(bucket: int, n: int, value: int, offset: int = 0) -> dict[str, list[Any]]:
    steps = [bucket * 64 + offset + i for i in range(n)]
    cols: dict[str, list[Any]] = {"step": steps, "ts": [1_700_000_000.0 + i for i in range(n)]}
    for name in ("step_ns", "dataloader_ns", "h2d_ns", "forward_ns", "backward_ns", "optimizer_ns", "wait_ns"):
        cols[name] = [value] * n
    return cols


def history_overflow(rng: random.Random, env: Env) -> Script:
    """History sums past int64: partials that pass their checks but overflow when merged,
    and rows so large that the daemon's own fold overflows."""
    bucket = rng.randrange(0, 2**40)
    variant = rng.choice(["merged partials", "folded rows", "negative fold", "top bucket"])
    bodies: list[tuple[str, bytes]] = []
    if variant == "merged partials":
        # Each batch's sum, 64 * (2**57 - 1), fits int64 (so its partial passes); three of them in one bucket do not.
        value = 2**57 - 1
        for i in range(3):
            bodies.append((f"64 steps of bucket {bucket} at 2**57-1 with partials ({i + 1} of 3)",
                           body_with_partials({"steps": _bucket_steps(bucket, 64, value)})))
    elif variant == "folded rows":
        for i in range(2):
            bodies.append((f"64 steps at 2**63-1, no partials ({i + 1} of 2)",
                           body_of({"steps": _bucket_steps(bucket, 64, 2**63 - 1)})))
    elif variant == "negative fold":
        bodies.append(("64 steps at -2**63, no partials", body_of({"steps": _bucket_steps(bucket, 64, -(2**63))})))
    else:
        top = (2**63 - 1) // 64
        bodies.append(("64 steps in the last int64 bucket at 2**62, with partials",
                       body_with_partials({"steps": _bucket_steps(top, 63, 2**62)})))
        bodies.append(("the same bucket again", body_with_partials({"steps": _bucket_steps(top, 63, 2**62)})))
    # A crafted partial at the limits of its checks: n=1, min=max=sum=2**63-1 for every metric.
    crafted = _bucket_steps(bucket, 1, 2**63 - 1, offset=1)
    stat: list[Any] = [1, crafted["step"][0], crafted["step"][0], 1_700_000_000.0]
    for _ in METRICS:
        stat += [1, 2**63 - 1, 2**63 - 1, 2**63 - 1]
    partial_cols = {name: [v] for name, v in zip(PARTIAL_COLUMNS, [bucket, *stat], strict=True)}
    bodies.append(("crafted partial n=1 with sums 2**63-1",
                   body_of({"steps": crafted}, history={"level": 64, "cols": partial_cols})))
    return content_script("history_overflow", rng, env, bodies)


def stats_values(rng: random.Random, env: Env) -> Script:
    """A relay's stats counters at boundary ints, non-finite, of wrong types, going down."""
    session, relay_sender, agent = _names("stats_values", env, rng)
    sender = f"{agent}/r7"
    frames: list[tuple[str, Any, int | None]] = []
    for seq in range(1, 5):
        name = rng.choice([*RELAY_COUNTERS, "fuzz_counter", rng.choice(ODD_STRINGS)])
        value: Any = rng.choice([*map(wire_int, BOUNDARY_INTS), *NONFINITE, "1", None, True, [1], {"a": 1}])
        stats = {"dropped_batches": 1, name: value}
        msg = messages.relay_batch(seq, [[sender, seq, small_body(rng, seq * 10)]], {sender: _identity(7, session)},
                                   dict(NODE), stats)
        if rng.random() < 0.3:
            msg["spool_dropped_upto"] = wire_int(rng.choice(BOUNDARY_INTS))
            msg["sender"] = relay_sender
        frames.append((f"stats {_short(name)}={_short(value)}", msg, seq))
    return relay_script("stats_values", rng, env, frames)


def identity_values(rng: random.Random, env: Env) -> Script:
    """Boundary ints (and wrong types, odd strings) in every identity field: the hello's,
    an rbatch's peers and its node; then steps, so the identity reaches storage and analysis."""
    where = rng.choice(["hello", "peers", "node"])
    name = rng.choice([*messages.IDENTITY_INT_FIELDS, *messages.IDENTITY_STR_FIELDS])
    if name in messages.IDENTITY_INT_FIELDS:
        value: Any = rng.choice([*map(wire_int, BOUNDARY_INTS), *NONFINITE, "0", True, None, [0]])
    else:
        value = rng.choice([*ODD_STRINGS, "h" * 10_000, b"host", 2**64 - 1, raw_str(b"\xff\xfe")])
    variant = f"{where} {name}={_short(value)}"
    session, relay_sender, agent = _names("identity_values", env, rng)
    sender = f"{agent}/r8"
    identity = _identity(8, session)
    bodies = [small_body(rng, 0, 3), body_with_partials({"steps": valid_table("steps", 70, rng, 64)})]
    if where == "hello":
        identity[name] = value
        endpoint = _endpoint(rng, env)
        hello = hello_template(messages.ROLE_AGENT, sender, session, identity)
        steps = tuple(Send(pack(messages.batch(seq, b)), f"batch {seq} after {variant}", seq)
                      for seq, b in enumerate(bodies, 1))
        return Script("identity_values", endpoint, hello, steps, hello_variant=variant)
    node: dict[str, Any] = dict(NODE)
    if where == "peers":
        identity[name] = value
    else:
        node[name] = value
    frames = [(f"rbatch {seq} with {variant}",
               messages.relay_batch(seq, [[sender, seq, b]], {sender: identity}, node, {}), seq)
              for seq, b in enumerate(bodies, 1)]
    return relay_script("identity_values", rng, env, frames)


def _huge(rng: random.Random) -> str:
    escape = rng.choice(["", "\x1b[31m", "[bold]"])
    return escape + rng.randbytes(HUGE_STRING_CHARS // 2).hex()[: HUGE_STRING_CHARS - len(escape)]


def huge_sender_ids(rng: random.Random, env: Env) -> Script:
    """8 MB sender ids in an rbatch: as an item's sender, a peers key, the relay's own sender field."""
    session, _, agent = _names("huge_sender_ids", env, rng)
    huge = _huge(rng)
    variant = rng.choice(["item and peers", "item only", "peers only", "rbatch sender field"])
    normal = f"{agent}/r9"
    items: list[list[Any]] = [[huge if variant.startswith("item") else normal, 1, small_body(rng)]]
    peers = {huge: _identity(9, session)} if variant in ("item and peers", "peers only") else {normal: _identity(9, session)}
    msg = messages.relay_batch(1, items, peers, dict(NODE), {"dropped_batches": 0})
    if variant == "rbatch sender field":
        msg["sender"] = huge
    return relay_script("huge_sender_ids", rng, env, [(f"8 MB sender id: {variant}", pack(msg), 1)])


def many_senders(rng: random.Random, env: Env) -> Script:
    """20,000 distinct agent senders in one rbatch (items, peers, or both)."""
    session, _, agent = _names("many_senders", env, rng)
    variant = rng.choice(["items and peers", "items only", "peers only"])
    body = small_body(rng, 0, 1)
    senders = [f"{agent}/r{i}" for i in range(MANY_SENDERS)]
    items = [[s, 1, body] for s in senders] if variant != "peers only" else [[senders[0], 1, body]]
    peers = {s: _identity(i, session) for i, s in enumerate(senders)} if variant != "items only" else {}
    msg = messages.relay_batch(1, items, peers, dict(NODE), {})
    return relay_script("many_senders", rng, env, [(f"{MANY_SENDERS} senders: {variant}", msg, 1)])


def many_keys(rng: random.Random, env: Env) -> Script:
    """50,000 keys: relay stats, peers identity, body tables, table columns, body extras."""
    variant = rng.choice(["stats", "identity", "tables", "columns", "body extra"])
    keys = [f"k{i:05d}{rng.choice(('', '[/]', chr(27)))}" for i in range(MANY_KEYS)]
    session, _, agent = _names("many_keys", env, rng)
    sender = f"{agent}/r10"
    if variant in ("stats", "identity"):
        identity = _identity(10, session)
        stats: dict[str, Any] = {}
        if variant == "stats":
            stats = dict.fromkeys(keys, 1)
        else:
            identity.update(dict.fromkeys(keys, 1))
        msgs = [(f"{MANY_KEYS} {variant} keys (rbatch {seq})",
                 messages.relay_batch(seq, [[sender, seq, small_body(rng, seq * 10)]], {sender: identity}, dict(NODE), stats), seq)
                for seq in (1, 2)]
        return relay_script("many_keys", rng, env, msgs)
    if variant == "tables":
        body = body_of({**{k: {"x": [1]} for k in keys}, "steps": valid_table("steps", 3, rng)})
    elif variant == "columns":
        cols = valid_table("steps", 3, rng)
        cols.update({k: [1, 2, 3] for k in keys})
        body = body_of({"steps": cols})
    else:
        body = body_of({"steps": valid_table("steps", 3, rng)}, extra=dict.fromkeys(keys, 0))
    return content_script("many_keys", rng, env, [(f"{MANY_KEYS} {variant} keys", body)])


def odd_strings(rng: random.Random, env: Env) -> Script:
    """Control and escape characters and Rich markup in every string position."""
    odd = rng.choice(ODD_STRINGS)
    where = rng.choice(["hello", "rbatch", "cells"])
    session = f"fuzz-odd_strings{odd[:40]}"
    if where == "hello":
        endpoint = _endpoint(rng, env)
        sender = f"fuzz-odd_strings/{env.index}/{odd}"[:200]
        identity = {**_identity(11, session), "hostname": odd, "device": odd, "parallelism": odd, "session": odd[:256]}
        hello = hello_template(messages.ROLE_AGENT, sender, session, identity)
        return Script("odd_strings", endpoint, hello, (Send(pack(messages.batch(1, small_body(rng))), "batch", 1),),
                      hello_variant=f"hello sender/session/identity {odd!r}")
    if where == "rbatch":
        _, relay_sender, _ = _names("odd_strings", env, rng)
        sender = f"{odd}/fuzz-odd_strings/{env.index}"
        identity = {**_identity(11, session), "hostname": odd, "device": odd}
        msg = messages.relay_batch(1, [[sender, 1, small_body(rng)]], {sender: identity}, {"node_rank": 9, "hostname": odd},
                                   {odd: 1, "dropped_batches": 0})
        return relay_script("odd_strings", rng, env, [(f"rbatch sender/hostname/stats key {odd!r}", msg, 1)])
    tables: dict[str, dict[str, list[Any]]] = {}
    for table, spec in TABLES.items():
        if any(k == TEXT for _, k in spec):
            cols = valid_table(table, 2, rng)
            for name, kind in spec:
                if kind == TEXT:
                    cols[name] = [odd, odd]
            tables[table] = cols
    tables[odd] = {odd: [odd]}
    return content_script("odd_strings", rng, env, [(f"every text cell {odd!r}", body_of(tables))])


def invalid_utf8(rng: random.Random, env: Env) -> Script:
    """Invalid UTF-8 in msgpack str positions, and bin bytes where strings are expected."""
    bad = raw_str(rng.choice(INVALID_UTF8))
    session, relay_sender, agent = _names("invalid_utf8", env, rng)
    sender = f"{agent}/r12"
    position = rng.choice(["t", "item sender", "stats key", "peers key", "hostname", "table name", "text cell",
                           "column name", "bytes item sender", "bytes text cell", "bytes table name", "bytes stats key"])
    body = small_body(rng)
    if position in ("table name", "text cell", "column name", "bytes text cell", "bytes table name"):
        cols = valid_table("scalars", 2, rng)
        tables: dict[Any, Any] = {"scalars": cols}
        if position == "table name":
            tables[bad] = {"x": [1]}
        elif position == "text cell":
            cols["name"] = [bad, "loss"]
        elif position == "column name":
            cols[bad] = [1, 2]
        elif position == "bytes text cell":
            cols["name"] = [b"loss", b"\xff"]
        else:
            tables[b"scalars"] = cols
        return content_script("invalid_utf8", rng, env, [(f"invalid UTF-8 / bytes as {position}", body_of(tables))])
    msg: dict[Any, Any] = messages.relay_batch(1, [[sender, 1, body]], {sender: _identity(12, session)}, dict(NODE), {})
    if position == "t":
        msg["t"] = bad
    elif position == "item sender":
        msg["items"] = [[bad, 1, body]]
    elif position == "stats key":
        msg["stats"] = {bad: 1}
    elif position == "peers key":
        msg["peers"] = {bad: {}}
    elif position == "hostname":
        msg["node"] = {"node_rank": 9, "hostname": bad}
    elif position == "bytes item sender":
        msg["items"] = [[sender.encode(), 1, body]]
    else:
        msg["stats"] = {b"dropped_batches": 1}
    return relay_script("invalid_utf8", rng, env, [(f"invalid UTF-8 / bytes as {position}", msg, 1)])


def deep_nesting(rng: random.Random, env: Env) -> Script:
    """Nesting far past anything sane in every position that takes a value."""
    depth = rng.choice([100, 900, 1100, 100_000])
    kind = rng.choice(["array", "map"])
    deep = nested(depth, kind)
    position = rng.choice(["envelope field", "peers identity field", "identity value", "stats value",
                           "body field", "text cell", "history"])
    label = f"{kind} nested {depth} deep as {position}"
    if position in ("body field", "text cell", "history"):
        cols = valid_table("scalars", 2, rng)
        if position == "body field":
            body = body_of({"scalars": cols}, zz=deep)
        elif position == "text cell":
            cols["name"] = [deep, "x"]
            body = body_of({"scalars": cols})
        else:
            body = body_of({"steps": valid_table("steps", 2, rng)}, history=deep)
        return content_script("deep_nesting", rng, env, [(label, body)])
    session, _, agent = _names("deep_nesting", env, rng)
    sender = f"{agent}/r13"
    identity: dict[str, Any] = _identity(13, session)
    msg: dict[str, Any] = messages.relay_batch(1, [[sender, 1, small_body(rng)]], {sender: identity}, dict(NODE), {})
    if position == "envelope field":
        msg["zz"] = deep
    elif position == "peers identity field":
        identity["zz"] = deep
    elif position == "identity value":
        identity["hostname"] = deep
    else:
        msg["stats"] = {"dropped_batches": deep}
    # Twice: the second rbatch meets the per-connection identity cache (an == on the nested value).
    second = dict(msg, seq=2, items=[[sender, 2, small_body(rng, 10)]])
    return relay_script("deep_nesting", rng, env, [(label, pack(msg), 1), (label + " (again)", pack(second), 2)])


def empty_arrays(rng: random.Random, env: Env) -> Script:
    """Empty items, peers, stats, tables, columns, bodies and partials."""
    position = rng.choice(["items", "empty body bytes", "empty body map", "no tables", "empty columns",
                           "empty partials", "one empty column", "empty sender"])
    session, relay_sender, agent = _names("empty_arrays", env, rng)
    sender = f"{agent}/r14"
    if position in ("items", "empty body bytes", "empty sender"):
        items: list[list[Any]] = {"items": [], "empty body bytes": [[sender, 1, b""]], "empty sender": [["", 1, small_body(rng)]]}[position]
        msg = messages.relay_batch(1, items, {}, {}, {})
        return relay_script("empty_arrays", rng, env, [(f"rbatch with {position}", msg, 1)])
    if position == "empty body map":
        body = pack({})
    elif position == "no tables":
        body = body_of({})
    elif position == "empty columns":
        body = body_of({t: {c: [] for c in columns(t)} for t in TABLES})
    elif position == "empty partials":
        body = body_of({"steps": valid_table("steps", 2, rng)}, history={"level": 64, "cols": {c: [] for c in PARTIAL_COLUMNS}})
    else:
        cols = valid_table("steps", 3, rng)
        cols["step_ns"] = []
        body = body_of({"steps": cols})
    return content_script("empty_arrays", rng, env, [(position, body)])


def wrong_types(rng: random.Random, env: Env) -> Script:
    """Type confusion inside bodies: the body, its tables, columns, cells and partials."""
    cols = valid_table("steps", 3, rng)
    choices: list[tuple[str, bytes]] = [
        ("body is a list", pack([1, 2])),
        ("body is an int", pack(5)),
        ("tables is a list", pack({"tables": [1]})),
        ("table is a list", body_of({"steps": [1, 2]})),
        ("column is a map", body_of({"steps": {**cols, "step_ns": {"a": 1}}})),
        ("column is a str", body_of({"steps": {**cols, "step_ns": "123"}})),
        ("int cell is a str", body_of({"steps": {**cols, "step_ns": ["1", 2, 3]}})),
        ("int cell is a list", body_of({"steps": {**cols, "step": [[1], 2, 3]}})),
        ("real cell is a map", body_of({"steps": {**cols, "ts": [{"a": 1}, 1.0, 2.0]}})),
        ("text cell is bytes", body_of({"scalars": {"step": [1], "name": [b"loss"], "value": [1.0]}})),
        ("text cell is an int", body_of({"scalars": {"step": [1], "name": [5], "value": [1.0]}})),
        ("bool cells", body_of({"steps": {**cols, "step_ns": [True, False, True]}})),
        ("ragged columns", body_of({"steps": {**cols, "step_ns": [1]}})),
        ("history is a str", body_of({"steps": cols}, history="h")),
        ("history level is a str", body_of({"steps": cols}, history={"level": "64", "cols": {}})),
        ("drops count is a str", body_of({"drops": {"ts": [1.0], "source": ["x"], "count": ["5"]}})),
        ("drops source is an int", body_of({"drops": {"ts": [1.0], "source": [5], "count": [5]}})),
        ("status with float step", body_of({"status": {**valid_table("status", 1, rng), "step": [1.5]}})),
    ]
    return content_script("wrong_types", rng, env, rng.sample(choices, 3))


def _short(value: Any) -> str:
    """A value as the report names it, never megabytes long."""
    if isinstance(value, Raw):
        return f"raw msgpack {value.data[:12]!r}{'...' if len(value.data) > 12 else ''} ({len(value.data)} bytes)"
    if isinstance(value, int) and not isinstance(value, bool):
        return int_name(value)
    if isinstance(value, dict):
        return f"map of {len(value)}"
    if isinstance(value, str | bytes) and len(value) > 40:
        return f"{value[:24]!r}... ({len(value)} long)"
    return repr(value)


KINDS: dict[str, Generator] = {
    "idle_unauthenticated": idle_unauthenticated,
    "slow_hello": slow_hello,
    "oversize_header": oversize_header,
    "truncated_frames": truncated_frames,
    "garbage_frames": garbage_frames,
    "bad_hello": bad_hello,
    "wrong_message_types": wrong_message_types,
    "seq_boundaries": seq_boundaries,
    "seq_jump_other_sender": seq_jump_other_sender,
    "stall_max_header": stall_max_header,
    "int_boundaries": int_boundaries,
    "nonfinite_floats": nonfinite_floats,
    "history_overflow": history_overflow,
    "stats_values": stats_values,
    "identity_values": identity_values,
    "huge_sender_ids": huge_sender_ids,
    "many_senders": many_senders,
    "many_keys": many_keys,
    "odd_strings": odd_strings,
    "invalid_utf8": invalid_utf8,
    "deep_nesting": deep_nesting,
    "empty_arrays": empty_arrays,
    "wrong_types": wrong_types,
}


def generate(kind: str, seed: int, index: int, relay: bool) -> Script:
    """Script number ``index`` of a run: a pure function of its arguments."""
    return KINDS[kind](random.Random(f"{seed}/{index}/{kind}"), Env(relay=relay, index=index))


def schedule(seed: int, kinds: Sequence[str]) -> Iterator[tuple[int, str]]:
    """(index, kind): every kind once per round, in an order shuffled per round from the seed."""
    for round_no in itertools.count():
        order = list(kinds)
        random.Random(f"{seed}/round/{round_no}").shuffle(order)
        for position, kind in enumerate(order):
            yield round_no * len(order) + position, kind


# ------------------------------------------------------------------ the raw client


class _Timeout:
    """No reply within the time given."""


TIMEOUT = _Timeout()
Reply = dict[str, Any] | None | _Timeout  # a message, None once the server closed, or TIMEOUT


class Conn:
    """One blocking TCP connection speaking frames (no product code beyond traceml_wire)."""

    def __init__(self, port: int, timeout: float, source: str | None = None) -> None:
        # ``source``: the local address to connect from (all of 127/8 is loopback on Linux).
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout,
                                             source_address=(source, 0) if source else None)
        self.decoder = FrameDecoder(DEFAULT_MAX_FRAME_BYTES)
        self.ready: deque[dict[str, Any]] = deque()

    def recv(self, timeout: float) -> Reply:
        deadline = time.monotonic() + timeout
        while not self.ready:
            left = deadline - time.monotonic()
            if left <= 0:
                return TIMEOUT
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                return TIMEOUT
            except OSError:
                return None
            if not data:
                return None
            try:
                bodies = self.decoder.feed(data)
                self.ready.extend(unpack_message(body) for body in bodies)
            except ProtocolError:
                return {"t": "garbage-from-server"}
        return self.ready.popleft()

    def send(self, data: bytes, timeout: float) -> str | None:
        """None once sent; else what stopped it: "closed", or "send_stalled" (the server stopped reading)."""
        self.sock.settimeout(timeout)
        try:
            self.sock.sendall(data)
        except TimeoutError:
            return "send_stalled"
        except OSError:
            return "closed"
        return None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


GOOD_ADDRESS = "127.0.0.1"  # good peers and probes connect from here


def attacker_address(index: int, connection: int = 0) -> str:
    """The source address of an attacker's connection: spread over 127.0.1.2 .. 127.0.250.251,
    so that per-address caps alone do not stop a flood and never count against the good peers."""
    n = index * 7919 + connection
    return f"127.0.{n // 250 % 250 + 1}.{n % 250 + 2}"


def fill_mac(template: dict[str, Any], token: str | None, nonce: bytes) -> dict[str, Any]:
    """The hello template with GOOD_MAC replaced by the MAC the server will verify."""
    message = dict(template)
    if message.get("mac") is GOOD_MAC:
        role, sender = message.get("role"), message.get("sender")
        good = isinstance(role, str) and isinstance(sender, str)
        message["mac"] = auth.hello_mac(token, nonce, role, sender) if good else b"\x00" * 32  # type: ignore[arg-type]
    return message


def await_reply(conn: Conn, seq: int | None, timeout: float) -> tuple[str, str]:
    """(outcome, reason) of the last message: acked / accepted / refused / closed / no_reply."""
    deadline = time.monotonic() + timeout
    while True:
        reply = conn.recv(max(0.0, deadline - time.monotonic()))
        if reply is TIMEOUT:
            return "no_reply", ""
        if reply is None:
            return "closed", ""
        assert isinstance(reply, dict)
        kind = reply.get("t")
        if kind == messages.ACK:
            ack = reply.get("seq")
            if seq is None or (isinstance(ack, int) and ack >= seq):
                return "acked", ""
        elif kind == messages.REFUSE:
            return "refused", str(reply.get("reason"))[:200]
        elif kind == messages.ACCEPT:
            return "accepted", ""
        elif kind != messages.CHALLENGE:
            return "unexpected", repr(kind)[:80]


def handshake(conn: Conn, template: dict[str, Any], token: str | None, timeout: float) -> tuple[str, str, int]:
    """(outcome, reason, accept.last_seq) of a hello built from ``template``."""
    challenge = conn.recv(timeout)
    if not isinstance(challenge, dict) or challenge.get("t") != messages.CHALLENGE:
        return ("no_reply" if challenge is TIMEOUT else "closed"), "no challenge", 0
    nonce = challenge.get("nonce")
    hello = fill_mac(template, token, nonce if isinstance(nonce, bytes) else b"")
    stopped = conn.send(encode_frame(pack(hello)), timeout)
    if stopped:
        return stopped, "", 0
    deadline = time.monotonic() + timeout
    reply = conn.recv(timeout)
    while isinstance(reply, dict) and reply.get("t") == messages.CHALLENGE:
        reply = conn.recv(max(0.0, deadline - time.monotonic()))
    if reply is TIMEOUT:
        return "no_reply", "", 0
    if reply is None:
        return "closed", "", 0
    assert isinstance(reply, dict)
    if reply.get("t") == messages.ACCEPT:
        last = reply.get("last_seq")
        return "accepted", "", last if isinstance(last, int) else 0
    if reply.get("t") == messages.REFUSE:
        return "refused", str(reply.get("reason"))[:200], 0
    return "unexpected", repr(reply.get("t"))[:80], 0


# ------------------------------------------------------------------ figures


@dataclass
class KindFigures:
    sent: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    # Per outcome, the first few variants that met it; per refusal, its reason.
    examples: dict[str, list[str]] = field(default_factory=dict)
    reasons: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {"sent": self.sent, "outcomes": dict(sorted(self.outcomes.items())),
                "examples": self.examples, "reasons": dict(self.reasons.most_common(6))}


class Tally:
    """Messages sent and their outcomes per kind, shared by every attacker thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.kinds: dict[str, KindFigures] = {}
        self.recent: deque[tuple[float, str, str, str]] = deque(maxlen=40)  # (t, kind, variant, outcome)

    def sent(self, kind: str, n: int = 1) -> None:
        with self._lock:
            self.kinds.setdefault(kind, KindFigures()).sent += n

    def outcome(self, kind: str, variant: str, outcome: str, reason: str = "", n: int = 1, t: float = 0.0) -> None:
        with self._lock:
            figures = self.kinds.setdefault(kind, KindFigures())
            figures.outcomes[outcome] += n
            examples = figures.examples.setdefault(outcome, [])
            if len(examples) < 4 and variant not in examples:
                examples.append(variant[:160])
            if reason and (reason in figures.reasons or len(figures.reasons) < 12):
                figures.reasons[reason] += n
            self.recent.append((t, kind, variant[:160], outcome))

    def snapshot(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {k: v.as_dict() for k, v in sorted(self.kinds.items())}

    @property
    def messages(self) -> int:
        with self._lock:
            return sum(f.sent for f in self.kinds.values())


# ------------------------------------------------------------------ parked sockets


MAX_PARKED = 3000  # our own file descriptors; the oldest goes first


@dataclass
class _Parked:
    kind: str
    variant: str
    sock: socket.socket
    trickle: bytes
    sent: int = 0
    decoder: FrameDecoder = field(default_factory=lambda: FrameDecoder(MAX_HELLO_FRAME_BYTES))


class ParkingLot:
    """Connections held open until the run ends; one thread watches them all and
    records what the server does to each (refused, closed) or that it held them."""


    def __init__(self, tally: Tally, clock: Callable[[], float]) -> None:
        self.tally = tally
        self.clock = clock
        self._lock = threading.Lock()
        self._new: list[_Parked] = []
        self._parked: dict[int, _Parked] = {}  # fd -> entry, in parking order
        self._per_kind: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="fuzz-parking", daemon=True)
        self._thread.start()

    def park(self, kind: str, variant: str, sock: socket.socket, trickle: bytes = b"") -> None:
        sock.setblocking(False)
        with self._lock:
            self._new.append(_Parked(kind, variant, sock, trickle))

    def __len__(self) -> int:
        with self._lock:
            return len(self._parked) + len(self._new)

    def count(self, kind: str) -> int:
        """Connections of ``kind`` held now (or about to be)."""
        with self._lock:
            return self._per_kind[kind] + sum(1 for e in self._new if e.kind == kind)

    def _resolve(self, selector: selectors.BaseSelector, entry: _Parked, outcome: str, reason: str = "") -> None:
        fd = entry.sock.fileno()
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(entry.sock)
        if self._parked.pop(fd, None) is not None:
            with self._lock:
                self._per_kind[entry.kind] -= 1
        with contextlib.suppress(OSError):
            entry.sock.close()
        self.tally.outcome(entry.kind, entry.variant, outcome, reason, t=self.clock())

    def _watch(self) -> None:
        selector = selectors.DefaultSelector()
        last_trickle = 0.0
        while not self._stop.is_set():
            with self._lock:
                new, self._new = self._new, []
            for entry in new:
                with self._lock:
                    self._per_kind[entry.kind] += 1
                self._parked[entry.sock.fileno()] = entry
                selector.register(entry.sock, selectors.EVENT_READ, entry)
            while len(self._parked) > MAX_PARKED:
                oldest = next(iter(self._parked.values()))
                self._resolve(selector, oldest, "held")
            for key, _ in selector.select(timeout=0.2) if self._parked else ():
                entry = key.data
                try:
                    data = entry.sock.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    self._resolve(selector, entry, "closed")
                    continue
                if not data:
                    self._resolve(selector, entry, "closed")
                    continue
                try:
                    bodies = entry.decoder.feed(data)
                    replies = [unpack_message(b) for b in bodies]
                except ProtocolError:
                    replies = [{"t": "garbage-from-server"}]
                for reply in replies:
                    if reply.get("t") == messages.REFUSE:
                        self._resolve(selector, entry, "refused", str(reply.get("reason"))[:200])
                        break
                    if reply.get("t") != messages.CHALLENGE:
                        self._resolve(selector, entry, "unexpected", repr(reply.get("t")))
                        break
            if not self._parked:
                time.sleep(0.05)
            now = time.monotonic()
            if now - last_trickle >= 1.0:
                last_trickle = now
                for entry in list(self._parked.values()):
                    if entry.trickle and entry.sent < len(entry.trickle):
                        try:
                            entry.sock.send(entry.trickle[entry.sent : entry.sent + 1])
                            entry.sent += 1
                        except BlockingIOError:
                            pass
                        except OSError:
                            self._resolve(selector, entry, "closed")
        with self._lock:
            new, self._new = self._new, []
        for entry in new:
            with self._lock:
                self._per_kind[entry.kind] += 1
            self._parked[entry.sock.fileno()] = entry
        for entry in list(self._parked.values()):
            self._resolve(selector, entry, "held")
        selector.close()

    def close(self) -> None:
        """Hang up on everything still parked (each counted "held": the server never closed it)."""
        self._stop.set()
        self._thread.join(30)


# ------------------------------------------------------------------ processes


def _tail(path: Path, lines: int = 30, max_line: int = 400) -> list[str]:
    """The last ``lines`` lines of a log file, each cut to ``max_line`` characters."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 256 * 1024))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return []
    out = [line if len(line) <= max_line else line[:max_line] + f"... ({len(line)} chars)" for line in text.splitlines()]
    return out[-lines:]


def _grep(path: Path, pattern: str, limit: int = 12, max_line: int = 300) -> list[str]:
    """Lines of a log file matching ``pattern`` (the first ``limit``), without reading it whole into memory."""
    found: list[str] = []
    regex = re.compile(pattern)
    try:
        with open(path, "rb") as fh:
            for raw in fh:
                line = raw[:4096].decode("utf-8", "replace").rstrip("\n")
                if regex.search(line):
                    found.append(line[:max_line])
                    if len(found) >= limit:
                        break
    except OSError:
        pass
    return found


class Proc:
    """A server process with its output in a file (a pipe nobody drains could stall it)."""

    def __init__(self, name: str, cmd: list[str], log: Path, ready: str, env: dict[str, str]) -> None:
        self.name = name
        self.cmd = cmd
        self.log = log
        self._ready = re.compile(ready)
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.peak_rss_kb = 0  # VmHWM, else the largest VmRSS seen
        self.idle_rss_kb = 0

    def start(self, timeout: float = 60.0) -> None:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in _tail(self.log, 50):
                found = self._ready.search(line)
                if found:
                    self.port = int(found.group(1))
                    self.sample()
                    self.idle_rss_kb = self.peak_rss_kb
                    return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.name} did not start: " + "\n".join(_tail(self.log)))

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def sample(self) -> int:
        """Current RSS in kB (and the peak so far kept in ``peak_rss_kb``); 0 once gone."""
        try:
            status = Path(f"/proc/{self.pid}/status").read_text()
        except OSError:
            return 0
        rss = hwm = 0
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1])
        self.peak_rss_kb = max(self.peak_rss_kb, rss, hwm)
        return rss

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; the exit code (None if it never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return -9999
        return self.proc.returncode


# ------------------------------------------------------------------ good peers


GOOD_SESSION = "fuzz-good"
GOOD_STEP_COLUMNS = columns("steps")


def good_row(salt: int, step: int) -> tuple[Any, ...]:
    """The exact steps row a good sender sends for ``step`` (``GOOD_STEP_COLUMNS`` order).
    ``salt`` holds the run's start in whole seconds (see ``_start_good``). Named by column:
    a column the steps table gains later is sent as None (not measured) until it is named here."""
    base = (step * 7919 + salt * 104_729) % 1_000_000
    values = {
        "step": step,
        "ts": float(salt) + step / 4,  # exact in a double
        "step_ns": 20_000_000 + base,
        "dataloader_ns": 2_000_000 + base % 1000,
        "h2d_ns": 100_000 + base % 77,
        "forward_ns": 6_000_000 + base % 5000,
        "backward_ns": 9_000_000 + base % 3000,
        "optimizer_ns": 2_000_000 + base % 100,
        "wait_ns": 900_000 + base % 10,
        "rss_bytes": (1 << 30) + step,
        "model_id": 0,
        "fwd_comm_ns": 300_000 + base % 7 if step % 2 else None,
        "device_timed": 1 if step % 3 == 0 else 0,
    }
    return tuple(values.get(column) for column in GOOD_STEP_COLUMNS)


def good_body(salt: int, first: int, n: int) -> bytes:
    rows = [good_row(salt, step) for step in range(first, first + n)]
    cols = {name: [row[i] for row in rows] for i, name in enumerate(GOOD_STEP_COLUMNS)}
    return encode_body({"steps": cols}, sent_ts=1_700_000_000.0)


BATCH_SIZES = (10, 64, 3, 70)  # 64 and 70 carry history partials


@dataclass
class GoodSender:
    sender: str
    salt: int
    identity: dict[str, Any]
    next_step: int = 0  # steps [0, next_step) were handed over


class GoodPeer:
    """A well-formed relay (rbatch to the daemon) or agent (batch to the daemon or relay)
    whose every step row is known. Reconnects like the real ones (resending what was not
    acknowledged); every refusal, cut-off or missing ack is a disruption on the record."""

    def __init__(self, name: str, role: str, port: int, token: str | None, senders: list[GoodSender],
                 clock: Callable[[], float], reply_timeout: float, interval: float = 0.1,
                 reconnect_every: int = 25) -> None:
        self.name = name
        self.role = role
        self.port = port
        self.token = token
        self.senders = senders
        self.clock = clock
        self.reply_timeout = reply_timeout
        self.interval = interval
        self.reconnect_every = reconnect_every
        self.relay_sender = f"relay/{GOOD_SESSION}/n0/{name}"
        self.unacked: dict[int, bytes] = {}  # seq -> frame
        self.seq = 0
        self.batches_acked = 0
        self.disruptions: list[tuple[float, str]] = []
        self.disruption_count = 0
        self.stop_sending = threading.Event()
        self.drained = threading.Event()
        self.drain_deadline = math.inf
        self._conn: Conn | None = None
        self.failed: str | None = None  # the sending thread died of this
        self._thread = threading.Thread(target=self._run, name=f"fuzz-good-{name}", daemon=True)

    @property
    def steps_sent(self) -> int:
        return sum(s.next_step for s in self.senders)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _disrupted(self, what: str) -> None:
        self.disruption_count += 1
        if len(self.disruptions) < 20:
            self.disruptions.append((round(self.clock(), 1), what))
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _hello(self) -> dict[str, Any]:
        if self.role == messages.ROLE_RELAY:
            return hello_template(self.role, self.relay_sender, GOOD_SESSION, {"node_rank": 0, "hostname": "good"})
        only = self.senders[0]
        return hello_template(self.role, only.sender, GOOD_SESSION, only.identity)

    def _connect(self) -> bool:
        try:
            conn = Conn(self.port, self.reply_timeout, GOOD_ADDRESS)
        except OSError as exc:
            self._disrupted(f"connect failed: {exc.__class__.__name__}")
            return False
        outcome, reason, last_seq = handshake(conn, self._hello(), self.token, self.reply_timeout)
        if outcome != "accepted":
            conn.close()
            self._disrupted(f"hello {outcome} {reason}".strip())
            return False
        self._conn = conn
        if self.role == messages.ROLE_AGENT:
            for seq in [s for s in self.unacked if s <= last_seq]:
                del self.unacked[seq]
        # Everything not acknowledged goes again, in order, as a real relay or agent does.
        for seq in sorted(self.unacked):
            if not self._send_and_wait(seq):
                return False
        return True

    def _send_and_wait(self, seq: int) -> bool:
        assert self._conn is not None
        stopped = self._conn.send(self.unacked[seq], self.reply_timeout)
        if stopped:
            self._disrupted(f"batch {seq}: {stopped}")
            return False
        outcome, reason = await_reply(self._conn, seq, self.reply_timeout)
        if outcome != "acked":
            what = "no ack within the liveness bound" if outcome == "no_reply" else outcome
            self._disrupted(f"batch {seq}: {what} {reason}".strip())
            return False
        for done in [s for s in self.unacked if s <= seq]:
            del self.unacked[done]
        self.batches_acked += 1
        return True

    def _next_batch(self) -> None:
        self.seq += 1
        n = BATCH_SIZES[self.seq % len(BATCH_SIZES)]
        if self.role == messages.ROLE_RELAY:
            items: list[list[Any]] = []
            for s in self.senders:
                items.append([s.sender, self.seq, good_body(s.salt, s.next_step, n)])
                s.next_step += n
            peers = {s.sender: s.identity for s in self.senders}
            message = messages.relay_batch(self.seq, items, peers, {"node_rank": 0, "hostname": "good"},
                                           {"dropped_batches": 0})
        else:
            s = self.senders[0]
            message = messages.batch(self.seq, good_body(s.salt, s.next_step, n))
            s.next_step += n
        self.unacked[self.seq] = encode_frame(pack(message))

    def _run(self) -> None:
        try:
            self._send_until_stopped()
        except Exception as exc:  # a bug of the fuzzer's: the judge names it, never a silent empty check
            self.failed = f"{type(exc).__name__}: {exc}"
            raise

    def _send_until_stopped(self) -> None:
        while not self.stop_sending.is_set():
            if self._conn is None and not self._connect():
                self.stop_sending.wait(0.5)
                continue
            self._next_batch()
            if not self._send_and_wait(self.seq):
                continue
            if self.seq % self.reconnect_every == 0 and self._conn is not None:
                # Real peers reconnect after blips: a new connection must get in while under attack.
                self._conn.send(encode_frame(pack(messages.bye())), 1.0)
                self._conn.close()
                self._conn = None
            self.stop_sending.wait(self.interval)
        while self.unacked and time.monotonic() < self.drain_deadline:
            if self._conn is None and not self._connect():
                time.sleep(0.5)
        if self._conn is not None:
            self._conn.send(encode_frame(pack(messages.bye())), 1.0)
            self._conn.close()
            self._conn = None
        self.drained.set()


# ------------------------------------------------------------------ the run


@dataclass
class FuzzConfig:
    duration_s: float
    seed: int
    with_relay: bool
    workdir: Path
    rss_cap_mb: float = 600.0
    kinds: tuple[str, ...] = tuple(KINDS)
    workers: int = 3
    torchrun_steps: int = 0  # > 0: also a real 2-rank gloo torchrun job traced by the agent
    # Liveness bound on one reply (an ack, a challenge), not a timing assertion: a daemon
    # that keeps a good peer's ack (or a fresh connection's challenge) waiting 10 s is stalled.
    reply_timeout_s: float = 10.0
    # Attackers connect from other loopback addresses than the good peers (another host, as
    # far as the server can tell); True: from 127.0.0.1 too (a hostile process on a good host).
    same_address: bool = False
    drain_timeout_s: float = 120.0
    token: str = "fuzz-token-4f1d9c"


@dataclass
class Death:
    process: str
    at_s: float
    what: str  # "exited with code 1", "stopped listening while its process still runs"
    returncode: int | None
    in_flight: list[str]
    recent: list[str]
    log_tail: list[str]


PROBE_TIMEOUT_S = 10.0  # a fresh connection waits this long for its challenge (FuzzConfig.reply_timeout_s)


def probe(port: int) -> str:
    """"ok" when a fresh connection gets its challenge; else what happened instead."""
    try:
        conn = Conn(port, PROBE_TIMEOUT_S, GOOD_ADDRESS)
    except OSError as exc:
        return f"connect failed: {exc.__class__.__name__}"
    try:
        reply = conn.recv(PROBE_TIMEOUT_S)
    finally:
        conn.close()
    if isinstance(reply, dict) and reply.get("t") == messages.CHALLENGE:
        return "ok"
    if isinstance(reply, dict) and reply.get("t") == messages.REFUSE:
        return f"refused: {str(reply.get('reason'))[:120]}"
    return f"no challenge within {PROBE_TIMEOUT_S:.0f} s" if reply is TIMEOUT else "closed without a challenge"


@dataclass
class FuzzReport:
    config: FuzzConfig
    elapsed_s: float = 0.0
    by_kind: dict[str, dict[str, Any]] = field(default_factory=dict)
    messages: int = 0
    daemon_peak_rss_mb: float = 0.0
    daemon_idle_rss_mb: float = 0.0
    relay_peak_rss_mb: float | None = None
    daemon_up: bool = True
    relay_up: bool | None = None
    daemon_exit: int | None = None
    relay_exit: int | None = None
    deaths: list[Death] = field(default_factory=list)
    # Per server: outcomes of a fresh connection made every second, and the first failures.
    probes: dict[str, dict[str, int]] = field(default_factory=dict)
    probe_failures: dict[str, list[str]] = field(default_factory=dict)
    good: dict[str, dict[str, Any]] = field(default_factory=dict)
    good_steps_sent: int = 0
    good_steps_stored: int = 0
    good_disruptions: int = 0
    torchrun: dict[str, Any] = field(default_factory=dict)
    driver_errors: list[str] = field(default_factory=list)
    daemon_errors: list[str] = field(default_factory=list)
    relay_errors: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        """Every figure, JSON-ready (the bench's last line)."""
        return {
            "duration_s": self.config.duration_s,
            "elapsed_s": round(self.elapsed_s, 1),
            "seed": self.config.seed,
            "with_relay": self.config.with_relay,
            "same_address": self.config.same_address,
            "messages": self.messages,
            "by_kind": {k: {"sent": v["sent"], "outcomes": v["outcomes"]} for k, v in self.by_kind.items()},
            "daemon_peak_rss_mb": round(self.daemon_peak_rss_mb, 1),
            "daemon_idle_rss_mb": round(self.daemon_idle_rss_mb, 1),
            "relay_peak_rss_mb": None if self.relay_peak_rss_mb is None else round(self.relay_peak_rss_mb, 1),
            "rss_cap_mb": self.config.rss_cap_mb,
            "good_steps_sent": self.good_steps_sent,
            "good_steps_stored": self.good_steps_stored,
            "good_disruptions": self.good_disruptions,
            "good": self.good,
            "torchrun": self.torchrun,
            "daemon_up": self.daemon_up,
            "relay_up": self.relay_up,
            "daemon_exit": self.daemon_exit,
            "relay_exit": self.relay_exit,
            "deaths": [{"process": d.process, "at_s": d.at_s, "what": d.what, "in_flight": d.in_flight}
                       for d in self.deaths],
            "probes": self.probes,
            "problems": len(self.problems),
        }

    def text(self) -> str:
        """The figures for people: per kind what was sent and what came of it, then the invariants."""
        where = "from 127.0.0.1 like the good peers" if self.config.same_address else "from other loopback addresses"
        lines = [f"fuzz: seed {self.config.seed}, {'relay in front of the daemon' if self.config.with_relay else 'daemon alone'}, "
                 f"{self.elapsed_s:.0f} s, {self.messages} messages, attackers {where}"]
        lines.append(f"{'kind':<24} {'sent':>7}  outcomes")
        for kind, figures in self.by_kind.items():
            outcomes = ", ".join(f"{k} {v}" for k, v in figures["outcomes"].items())
            lines.append(f"{kind:<24} {figures['sent']:>7}  {outcomes}")
        relay_rss = "" if self.relay_peak_rss_mb is None else f"; relay peak RSS {self.relay_peak_rss_mb:.0f} MB"
        lines.append(f"daemon peak RSS {self.daemon_peak_rss_mb:.0f} MB (idle {self.daemon_idle_rss_mb:.0f} MB, "
                     f"cap {self.config.rss_cap_mb:.0f} MB){relay_rss}")
        lines.append(f"good steps sent {self.good_steps_sent}, stored {self.good_steps_stored}; "
                     f"good-peer disruptions {self.good_disruptions}")
        for name, good in self.good.items():
            lines.append(f"  {name}: {json.dumps(good, default=str)[:600]}")
        if self.torchrun:
            lines.append(f"  torchrun: {json.dumps(self.torchrun, default=str)[:600]}")
        lines.append(f"daemon up {self.daemon_up} (exit {self.daemon_exit})"
                     + ("" if self.relay_up is None else f"; relay up {self.relay_up} (exit {self.relay_exit})"))
        return "\n".join(lines)

    def failure_message(self) -> str:
        return f"{len(self.problems)} invariant(s) broken:\n\n" + "\n\n".join(
            f"[{i}] {p}" for i, p in enumerate(self.problems, 1)) + "\n\n" + self.text()


class Fuzzer:
    def __init__(self, config: FuzzConfig) -> None:
        self.config = config
        self.workdir = Path(config.workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.db = self.workdir / "fuzz.db"
        self.token_file = self.workdir / "token"
        self.token_file.write_text(config.token + "\n")
        self.tally = Tally()
        self.t0 = time.monotonic()
        self.stop = threading.Event()
        self.daemon: Proc | None = None
        self.relay: Proc | None = None
        self.parking: ParkingLot | None = None
        self.good: list[GoodPeer] = []
        self.torch: subprocess.Popen[bytes] | None = None
        self.in_flight: dict[int, str] = {}
        self.deaths: list[Death] = []
        # The first refused connect: a crashing server stops listening well before it exits.
        self.first_refusal: tuple[float, list[str], list[str]] | None = None
        self.driver_errors: list[str] = []
        self._schedule = schedule(config.seed, config.kinds)
        self._schedule_lock = threading.Lock()
        self._sampler_stop = threading.Event()
        self._down: dict[str, Death] = {}
        self.probes: dict[str, Counter[str]] = {}
        self.probe_failures: dict[str, list[str]] = {}
        for kind in config.kinds:
            if kind not in KINDS:
                raise ValueError(f"unknown attack kind {kind!r}; known: {', '.join(KINDS)}")

    def clock(self) -> float:
        return time.monotonic() - self.t0

    # -------------------------------------------------------------- processes

    def _start_servers(self) -> None:
        env = base_env()
        self.daemon = Proc(
            "daemon",
            [sys.executable, "-m", "traceml_daemon", "serve", "--host", "127.0.0.1", "--port", "0",
             "--db", str(self.db), "--token-file", str(self.token_file)],
            self.workdir / "daemon.log", r"listening on 127\.0\.0\.1:(\d+)", env,
        )
        self.daemon.start()
        if self.config.with_relay:
            self.relay = Proc(
                "relay",
                [sys.executable, "-m", "relay", "--host", "127.0.0.1", "--port", "0",
                 "--daemon", f"127.0.0.1:{self.daemon.port}", "--token-file", str(self.token_file),
                 "--node-rank", "0", "--session", GOOD_SESSION, "--spool-dir", str(self.workdir / "relay-spool"),
                 "--flush-timeout", "60"],
                self.workdir / "relay.log", r"relay listening on 127\.0\.0\.1:(\d+)", env,
            )
            self.relay.start()

    def _procs(self) -> list[Proc]:
        return [p for p in (self.daemon, self.relay) if p is not None]

    def _sampler(self) -> None:
        """RSS of every server, and the moment one exits (with what was in flight)."""
        while not self._sampler_stop.wait(0.2):
            for proc in self._procs():
                proc.sample()
                if not proc.alive():
                    self._record_down(proc, f"exited with code {proc.proc.returncode if proc.proc else None}")

    def _prober(self) -> None:
        """A fresh connection to every server each second: a server that stopped listening
        (its process still there) is down, one that refuses or never challenges locks peers out."""
        while not self._sampler_stop.wait(1.0):
            for proc in self._procs():
                if proc.name in self._down:
                    continue
                result = probe(proc.port)
                self.probes.setdefault(proc.name, Counter())[result] += 1
                if result == "ok" or self._sampler_stop.is_set():
                    continue
                if result.startswith("connect failed") and proc.alive():
                    self._record_down(proc, f"stopped listening while its process still runs ({result})")
                    continue
                failures = self.probe_failures.setdefault(proc.name, [])
                if len(failures) < 8:
                    kinds = ", ".join(sorted(set(self.in_flight.values()))) or "none"
                    failures.append(f"t={self.clock():.1f}s {result} (kinds in flight: {kinds})")

    def _record_down(self, proc: Proc, what: str) -> None:
        """The first time a server is seen down; a later exit is added to that record."""
        death = self._down.get(proc.name)
        if death is not None:
            if not proc.alive() and "exited" not in death.what:
                death.what += f"; exited with code {proc.proc.returncode if proc.proc else None} at t={self.clock():.1f}s"
                death.returncode = proc.proc.returncode if proc.proc else None
                death.log_tail = _tail(proc.log, 40)
            return
        recent = [f"t={t:.1f}s {k}: {v} -> {o}" for t, k, v, o in list(self.tally.recent)[-12:]]
        death = Death(proc.name, round(self.clock(), 1), what, proc.proc.returncode if proc.proc else None,
                      sorted(set(self.in_flight.values())), recent, _tail(proc.log, 40))
        self._down[proc.name] = death
        self.deaths.append(death)
        self.stop.set()  # every later attack would only meet a closed port

    def _start_torchrun(self) -> None:
        assert self.daemon is not None
        relay_port = self.relay.port if self.relay is not None else free_port()
        env = base_env(
            TRACEML_DAEMON=f"127.0.0.1:{self.daemon.port}", TRACEML_TOKEN=self.config.token,
            TRACEML_RELAY_PORT=str(relay_port), TRACEML_SESSION=f"{GOOD_SESSION}-torch",
            TRACEML_SPOOL_DIR=str(self.workdir / "torch-spool"),
            # Under attack the daemon is slow, not gone: give the final flush room.
            TRACEML_SHUTDOWN_S="60",
        )
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(REPO / "examples" / "train.py"),
               "--steps", str(self.config.torchrun_steps), "--slow-ranks", "0,1", "--slow-ms", "40"]
        with open(self.workdir / "torchrun.log", "wb") as out:
            self.torch = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)

    def _start_good(self) -> None:
        assert self.daemon is not None
        timeout = self.config.reply_timeout_s

        # The salt starts at the run's wall clock: the good rows' ts are then current, and the
        # daemon's default retention by age (which a hostile row with ts=inf anchors at now)
        # never has a right to them; 2023-dated rows were deleted in slow runs, acked.
        started = int(time.time())

        def sender(name: str, rank: int, salt: int) -> GoodSender:
            salt += started
            identity = {"session": GOOD_SESSION, "attempt": 0, "global_rank": rank, "local_rank": rank, "node_rank": 0,
                        "world_size": 4, "local_world_size": 4, "nnodes": 1, "hostname": "good", "pid": 100 + rank}
            return GoodSender(f"{GOOD_SESSION}/a0/n0/r{rank}/{name}", salt, identity)

        self.good.append(GoodPeer("good-relay", messages.ROLE_RELAY, self.daemon.port, self.config.token,
                                  [sender("relay-a", 0, 1), sender("relay-b", 1, 2)], self.clock, timeout))
        agent_port = self.relay.port if self.relay is not None else self.daemon.port
        self.good.append(GoodPeer("good-agent", messages.ROLE_AGENT, agent_port, self.config.token,
                                  [sender("agent", 2, 3)], self.clock, timeout))
        for peer in self.good:
            peer.start()

    # -------------------------------------------------------------- attackers

    def _attacker(self, worker: int) -> None:
        while not self.stop.is_set():
            with self._schedule_lock:
                index, kind = next(self._schedule)
            self.in_flight[worker] = kind
            try:
                script = generate(kind, self.config.seed, index, self.config.with_relay)
                self._execute(script, index)
            except Exception:
                error = traceback.format_exc(limit=4)
                self.tally.outcome(kind, "driver", "driver_error", error.splitlines()[-1][:200], t=self.clock())
                if len(self.driver_errors) < 10:
                    self.driver_errors.append(f"{kind} #{index}: {error}")
            finally:
                self.in_flight.pop(worker, None)

    def _port(self, endpoint: str) -> int:
        proc = self.relay if endpoint == "relay" and self.relay is not None else self.daemon
        assert proc is not None
        return proc.port

    def _connect(self, script: Script, index: int, connection: int = 0) -> Conn | None:
        source = GOOD_ADDRESS if self.config.same_address else attacker_address(index, connection)
        try:
            return Conn(self._port(script.endpoint), self.config.reply_timeout_s, source)
        except OSError as exc:
            if self.first_refusal is None:
                recent = [f"t={t:.1f}s {k}: {v} -> {o}" for t, k, v, o in list(self.tally.recent)[-12:]]
                self.first_refusal = (round(self.clock(), 1), sorted(set(self.in_flight.values())), recent)
            self.tally.sent(script.kind)
            self.tally.outcome(script.kind, f"connect to {script.endpoint}", "connect_failed", exc.__class__.__name__,
                               t=self.clock())
            return None

    def _execute(self, script: Script, index: int) -> None:
        timeout = self.config.reply_timeout_s
        assert self.parking is not None
        parks = any(isinstance(s, Park) or isinstance(s, SendRaw) and s.then == "park" for s in script.steps)
        if parks and self.parking.count(script.kind) >= script.max_parked:
            self.stop.wait(0.2)  # enough of these are held already: they stay until the run ends
            return
        if script.hello is None and all(isinstance(s, Park) for s in script.steps):
            park = script.steps[0]
            assert isinstance(park, Park)
            for connection in range(script.connections):
                if self.stop.is_set() or self.parking.count(script.kind) >= script.max_parked:
                    return
                conn = self._connect(script, index, connection)
                if conn is None:
                    return
                self.tally.sent(script.kind)
                self.parking.park(script.kind, f"{script.endpoint}: {park.variant}", conn.sock, park.trickle)
            return
        conn: Conn | None = None
        for step in script.steps:
            parks = isinstance(step, Park) or isinstance(step, SendRaw) and step.then == "park"
            if self.stop.is_set() or parks and self.parking.count(script.kind) >= script.max_parked:
                break
            if conn is None:
                conn = self._connect(script, index)
                if conn is None:
                    return
                if script.hello is not None:
                    self.tally.sent(script.kind)
                    outcome, reason, _ = handshake(conn, script.hello, self.config.token, timeout)
                    self.tally.outcome(script.kind, f"{script.endpoint}: hello: {script.hello_variant}", outcome, reason,
                                       t=self.clock())
                    if outcome != "accepted":
                        conn.close()
                        return  # the hello was the attack, or the server is refusing everyone
            variant = f"{script.endpoint}: {step.variant}"
            self.tally.sent(script.kind)
            if isinstance(step, Park):
                self.parking.park(script.kind, variant, conn.sock, step.trickle)
                conn = None
                continue
            if isinstance(step, Send):
                stopped = conn.send(encode_frame(step.payload), timeout)
                outcome, reason = (stopped, "") if stopped else await_reply(conn, step.seq, timeout)
            else:
                stopped = conn.send(step.data, timeout)
                if not stopped and step.then == "park":
                    self.parking.park(script.kind, variant, conn.sock)
                    conn = None
                    continue
                if not stopped and step.then == "hang_up":
                    with contextlib.suppress(OSError):
                        conn.sock.shutdown(socket.SHUT_WR)
                outcome, reason = (stopped, "") if stopped else await_reply(conn, None, timeout)
            self.tally.outcome(script.kind, variant, outcome, reason, t=self.clock())
            if outcome != "acked":
                conn.close()
                conn = None  # the next step starts a new connection
        if conn is not None:
            conn.close()

    # -------------------------------------------------------------- the whole run

    def run(self) -> FuzzReport:
        report = FuzzReport(self.config)
        sampler = threading.Thread(target=self._sampler, name="fuzz-sampler", daemon=True)
        prober = threading.Thread(target=self._prober, name="fuzz-prober", daemon=True)
        attackers: list[threading.Thread] = []
        try:
            self._start_servers()
            self.parking = ParkingLot(self.tally, self.clock)
            self.t0 = time.monotonic()
            sampler.start()
            prober.start()
            self._start_good()
            if self.config.torchrun_steps > 0:
                self._start_torchrun()
            attackers = [threading.Thread(target=self._attacker, args=(w,), name=f"fuzz-attacker-{w}", daemon=True)
                         for w in range(self.config.workers)]
            for thread in attackers:
                thread.start()
            self.stop.wait(self.config.duration_s)
            self.stop.set()
            for thread in attackers:
                thread.join(self.config.reply_timeout_s * 2 + 10)
            self.parking.close()
            report.elapsed_s = self.clock()
            self._finish_good(report)
        finally:
            self.stop.set()
            if self.parking is not None:
                self.parking.close()
            # Watching ends before the clean stop: a server exiting on SIGTERM is no death.
            self._sampler_stop.set()
            for thread in (sampler, prober):
                if thread.is_alive():
                    thread.join(PROBE_TIMEOUT_S * 2 + 5)
            self._finish_processes(report)
        self._read_db(report)
        self._judge(report)
        return report

    def _finish_good(self, report: FuzzReport) -> None:
        # A dead server stores nothing more: no point waiting out the whole drain.
        drain = 5.0 if self.deaths else self.config.drain_timeout_s
        deadline = time.monotonic() + drain
        for peer in self.good:
            peer.drain_deadline = deadline
            peer.stop_sending.set()
        if self.torch is not None:
            try:
                self.torch.wait(max(1.0, deadline - time.monotonic()) + 120)
            except subprocess.TimeoutExpired:
                self.torch.kill()
                self.torch.wait()
        for peer in self.good:
            peer.join(max(1.0, deadline - time.monotonic()) + 5)

    def _finish_processes(self, report: FuzzReport) -> None:
        if self.torch is not None and self.torch.poll() is None:
            self.torch.kill()
            self.torch.wait()
        for proc in self._procs():
            proc.sample()
        for proc in self._procs():
            if not proc.alive():
                self._record_down(proc, f"exited with code {proc.proc.returncode if proc.proc else None}")
        report.daemon_up = "daemon" not in self._down
        if self.relay is not None:
            report.relay_up = "relay" not in self._down
            # The relay first: its final flush goes to the daemon.
            report.relay_exit = self.relay.stop(90)
        if self.daemon is not None:
            report.daemon_exit = self.daemon.stop(90)

    # -------------------------------------------------------------- the database

    def _read_db(self, report: FuzzReport) -> None:
        report.by_kind = self.tally.snapshot()
        report.messages = self.tally.messages
        report.deaths = list(self.deaths)
        report.probes = {name: dict(c) for name, c in self.probes.items()}
        report.probe_failures = dict(self.probe_failures)
        report.driver_errors = list(self.driver_errors)
        if self.daemon is not None:
            report.daemon_peak_rss_mb = self.daemon.peak_rss_kb / 1024
            report.daemon_idle_rss_mb = self.daemon.idle_rss_kb / 1024
            report.daemon_errors = _grep(self.daemon.log, r"Traceback|ERROR|CRITICAL|Error:|exception", limit=20)
        if self.relay is not None:
            report.relay_peak_rss_mb = self.relay.peak_rss_kb / 1024
            report.relay_errors = _grep(self.relay.log, r"Traceback|unexpected|Error", limit=20)
        report.good_disruptions = sum(p.disruption_count for p in self.good)
        try:
            conn = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=30)
        except sqlite3.Error as exc:
            report.problems.append(f"cannot open the database {self.db}: {exc}")
            return
        try:
            for peer in self.good:
                report.good[peer.name] = self._check_good(conn, peer)
            if self.config.torchrun_steps > 0:
                report.torchrun = self._check_torch(conn)
        except sqlite3.Error as exc:
            report.problems.append(f"cannot read the database {self.db}: {exc}")
        finally:
            conn.close()
        report.good_steps_sent = sum(g["steps_sent"] for g in report.good.values()) + report.torchrun.get("steps_sent", 0)
        report.good_steps_stored = sum(g["steps_stored"] for g in report.good.values()) + report.torchrun.get(
            "steps_stored", 0)

    def _check_good(self, conn: sqlite3.Connection, peer: GoodPeer) -> dict[str, Any]:
        """Every row of the peer's senders compared with what was sent, exactly."""
        out: dict[str, Any] = {"steps_sent": peer.steps_sent, "steps_stored": 0, "missing": 0, "duplicated": 0,
                               "altered": 0, "batches_acked": peer.batches_acked, "unacked_at_end": len(peer.unacked),
                               "disruptions": peer.disruption_count, "first_disruptions": peer.disruptions[:8],
                               "failed": peer.failed}
        altered_examples: list[str] = []
        cols = ", ".join(f"s.{c}" for c in GOOD_STEP_COLUMNS)
        for s in peer.senders:
            seen: Counter[int] = Counter()
            rows = conn.execute(f"SELECT {cols} FROM steps s JOIN ranks r USING (rank_id) WHERE r.sender = ?", (s.sender,))
            for row in rows:
                out["steps_stored"] += 1
                step = row[0]
                seen[step] += 1
                if not isinstance(step, int) or not 0 <= step < s.next_step or tuple(row) != good_row(s.salt, step):
                    out["altered"] += 1
                    if len(altered_examples) < 3:
                        altered_examples.append(f"{s.sender} stored {tuple(row)!r}")
            out["missing"] += sum(1 for step in range(s.next_step) if seen[step] == 0)
            out["duplicated"] += sum(n - 1 for n in seen.values() if n > 1)
            identity = conn.execute("SELECT global_rank, node_rank, session FROM ranks WHERE sender = ?", (s.sender,)).fetchone()
            expected = (s.identity["global_rank"], s.identity["node_rank"], GOOD_SESSION)
            if seen and identity != expected:
                out.setdefault("identity_wrong", []).append(f"{s.sender}: {identity!r} != {expected!r}")
        if altered_examples:
            out["altered_examples"] = altered_examples
        return out

    def _check_torch(self, conn: sqlite3.Connection) -> dict[str, Any]:
        n = self.config.torchrun_steps
        session = f"{GOOD_SESSION}-torch"
        out: dict[str, Any] = {"steps_sent": 2 * n, "steps_stored": 0, "returncode": None if self.torch is None else self.torch.returncode}
        ranks = conn.execute("SELECT rank_id, sender, global_rank FROM ranks WHERE session = ?", (session,)).fetchall()
        out["ranks"] = sorted(r[2] for r in ranks if r[2] is not None)
        problems: list[str] = []
        for rank_id, sender, global_rank in ranks:
            steps = [row[0] for row in conn.execute(
                "SELECT s.step FROM steps s JOIN ranks r USING (rank_id) WHERE r.rank_id = ?", (rank_id,))]
            out["steps_stored"] += len(steps)
            counts = Counter(steps)
            missing = [s for s in range(n) if counts[s] == 0]
            dup = sum(c - 1 for c in counts.values() if c > 1)
            extra = sorted(s for s in counts if not (isinstance(s, int) and 0 <= s < n))
            if missing or dup or extra:
                problems.append(f"rank {global_rank} ({sender}): {len(missing)} missing (first {missing[:5]}), "
                                f"{dup} duplicated, steps outside 0..{n - 1}: {extra[:5]}")
        if problems:
            out["problems"] = problems
        return out

    # -------------------------------------------------------------- invariants

    def _judge(self, report: FuzzReport) -> None:
        """Every broken invariant as one precise sentence (with the evidence)."""
        problems = report.problems
        for death in report.deaths:
            first = ""
            if self.first_refusal is not None and self.first_refusal[0] <= death.at_s:
                at, kinds, recent = self.first_refusal
                first = (f"\nAttackers were first refused a connection at t={at} s; kinds in flight then: "
                         f"{', '.join(kinds) or 'none'}; last messages and outcomes before that:\n  " + "\n  ".join(recent))
            problems.append(
                f"the {death.process} went down at t={death.at_s} s of the run: {death.what}. Kinds in flight: "
                f"{', '.join(death.in_flight) or 'none'}.{first}"
                + f"\nLast {death.process} output lines:\n  " + "\n  ".join(death.log_tail[-25:]))
        if report.daemon_exit not in (0, None) and report.daemon_up:
            problems.append(f"the daemon did not stop cleanly on SIGTERM: exit {report.daemon_exit}; last lines:\n  "
                            + "\n  ".join(_tail(self.workdir / "daemon.log", 15)))
        if self.relay is not None and report.relay_exit not in (0, None) and report.relay_up:
            problems.append(f"the relay did not stop cleanly on SIGTERM: exit {report.relay_exit}; last lines:\n  "
                            + "\n  ".join(_tail(self.workdir / "relay.log", 15)))
        for name, failures in report.probe_failures.items():
            counts = report.probes.get(name, {})
            failed = sum(n for outcome, n in counts.items() if outcome != "ok")
            problems.append(f"the {name} locked fresh connections out: {failed} of {sum(counts.values())} probes "
                            f"(one a second) got no challenge; first: " + "; ".join(failures))
        cap = self.config.rss_cap_mb
        if report.daemon_peak_rss_mb > cap:
            problems.append(f"daemon peak RSS {report.daemon_peak_rss_mb:.0f} MB is over the cap of {cap:.0f} MB "
                            f"(idle {report.daemon_idle_rss_mb:.0f} MB); bytes-heavy kinds sent: "
                            + _heavy(report.by_kind))
        if report.relay_peak_rss_mb is not None and report.relay_peak_rss_mb > cap:
            problems.append(f"relay peak RSS {report.relay_peak_rss_mb:.0f} MB is over the cap of {cap:.0f} MB")
        for name, good in report.good.items():
            if good.get("failed") or not good["steps_sent"]:
                # Nothing sent makes every check below vacuous: a fault of the fuzzer, named as one.
                problems.append(f"{name}: the good peer sent {good['steps_sent']} steps; its thread "
                                f"{'died of ' + good['failed'] if good.get('failed') else 'never got a batch out'}")
            bad = good["missing"] or good["duplicated"] or good["altered"] or good.get("identity_wrong") \
                or good["steps_stored"] != good["steps_sent"]
            if bad:
                problems.append(
                    f"{name}: good steps not stored exactly once with exact values: sent {good['steps_sent']}, "
                    f"stored {good['steps_stored']} (missing {good['missing']}, duplicated {good['duplicated']}, "
                    f"altered {good['altered']}; {good['unacked_at_end']} batches never acknowledged; "
                    f"{good.get('identity_wrong', '')} {good.get('altered_examples', '')}). "
                    f"First disruptions: {good['first_disruptions']}")
            if good["disruptions"]:
                problems.append(
                    f"{name}: the good peer was refused, cut off or left without an ack {good['disruptions']} time(s) "
                    f"while attackers ran (t = seconds into the run): {good['first_disruptions']}")
        if self.config.torchrun_steps > 0:
            torch = report.torchrun
            if torch.get("returncode") != 0:
                problems.append(f"the torchrun job exited with {torch.get('returncode')}: "
                                + "\n  ".join(_tail(self.workdir / "torchrun.log", 20)))
            if torch.get("problems") or torch["steps_stored"] != torch["steps_sent"] or len(torch.get("ranks", [])) != 2:
                problems.append(f"torchrun job: steps not stored exactly once: expected 2 ranks x "
                                f"{self.config.torchrun_steps} steps, stored {torch['steps_stored']} for ranks "
                                f"{torch.get('ranks')}; {torch.get('problems', '')}")
        for error in report.driver_errors[:3]:
            problems.append(f"fuzzer driver error (a bug in the fuzzer, not the product): {error}")
        if problems:
            evidence = self._log_evidence()
            if evidence:
                problems.append("server log evidence (first matching lines):" + evidence)

    def _log_evidence(self) -> str:
        out = ""
        for proc in self._procs():
            # The product's own errors and the exceptions' last lines, not asyncio's shutdown noise.
            lines = [line for line in _grep(proc.log, r"ERROR traceml|[A-Za-z]+Error: |too many connections|relay: ",
                                            limit=40) if "TaskGroup" not in line][:10]
            if lines:
                out += f"\n{proc.name} log evidence:\n  " + "\n  ".join(lines)
        return out


def _heavy(by_kind: dict[str, dict[str, Any]]) -> str:
    heavy = ("huge_sender_ids", "many_senders", "many_keys", "stall_max_header", "idle_unauthenticated")
    return ", ".join(f"{k} x{by_kind[k]['sent']}" for k in heavy if k in by_kind) or "none"


def run_fuzz(config: FuzzConfig) -> FuzzReport:
    """Start the servers, fuzz for ``config.duration_s`` beside the good peers, stop, judge."""
    return Fuzzer(config).run()
