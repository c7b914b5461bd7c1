"""traceml_wire.limits, .aio and .ratelimit: the connection discipline both servers
share (slots, timeouts, the byte budget, keepalive) and the rate of repeated lines."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import struct

import pytest

from traceml_wire import auth, messages
from traceml_wire.aio import ByteBudget, IdleTimeout, ReadTimeout, ServerReader
from traceml_wire.connection_events import Event, Hello, RelayBatch
from traceml_wire.framing import encode_frame
from traceml_wire.limits import ConnectionGate, ConnectionLimits, keepalive_options, set_keepalive
from traceml_wire.ratelimit import LineLimiter
from traceml_wire.server_connection import ServerConnection

LIMITS = ConnectionLimits(
    max_connections=2,
    max_unauthenticated=3,
    max_unauthenticated_per_address=2,
    hello_timeout=10.0,
    read_timeout=0.2,
    idle_timeout=0.2,
    inbound_bytes=1000,
    keepalive_idle=60,
    keepalive_interval=10,
    keepalive_count=6,
)


# ------------------------------------------------------------------ the gate


def test_authenticated_peers_have_their_own_cap_and_unauthenticated_ones_theirs() -> None:
    gate: ConnectionGate[str] = ConnectionGate(LIMITS)
    for name in ("a", "b"):
        assert gate.admit(name, f"10.0.0.{name}").admitted
        assert gate.authenticate(name) is None
    assert gate.authenticated == 2 and gate.unauthenticated == 0
    # Both authenticated slots taken: a newcomer is refused before its hello costs anything.
    refused = gate.admit("c", "10.0.0.9")
    assert not refused.admitted and refused.reason == "too many connections" and refused.evict == ()
    gate.release("a")
    assert gate.admit("c", "10.0.0.9").admitted


def test_unauthenticated_peers_never_take_an_authenticated_slot() -> None:
    gate: ConnectionGate[str] = ConnectionGate(LIMITS)
    for i, address in enumerate(("10.0.0.1", "10.0.0.2", "10.0.0.3")):
        assert gate.admit(f"idle{i}", address).admitted
    # The unauthenticated cap is full of silent sockets: the relay with the token takes
    # the oldest one's slot, and its hello is accepted.
    admission = gate.admit("relay", "10.0.0.7")
    assert admission.admitted and admission.evict == ("idle0",)
    assert gate.authenticate("relay") is None
    # The evicted peer's hello, had it come after all, is refused; its release does nothing.
    assert gate.authenticate("idle0") is not None
    gate.release("idle0")
    assert gate.unauthenticated == 2 and gate.authenticated == 1 and gate.evicted == 1


def test_a_full_address_gives_up_its_own_oldest_slot_not_another_address() -> None:
    gate: ConnectionGate[str] = ConnectionGate(LIMITS)
    assert gate.admit("other", "10.0.0.9").admitted
    assert gate.admit("x1", "10.0.0.1").admitted
    assert gate.admit("x2", "10.0.0.1").admitted
    admission = gate.admit("x3", "10.0.0.1")
    assert admission.admitted and admission.evict == ("x1",)  # not "other", though it is older


def test_a_stream_of_fresh_idle_sockets_never_locks_a_newcomer_out() -> None:
    gate: ConnectionGate[str] = ConnectionGate(LIMITS)
    for i in range(1000):  # however fast they are renewed, each newcomer gets a slot
        admission = gate.admit(f"idle{i}", f"10.0.1.{i % 7}")
        assert admission.admitted
        assert gate.unauthenticated <= LIMITS.max_unauthenticated
    assert gate.admit("relay", "10.0.0.7").admitted and gate.authenticate("relay") is None
    assert gate.refused == 0 and gate.evicted == 1000 + 1 - LIMITS.max_unauthenticated


def test_an_authenticated_slot_filled_while_a_hello_was_on_the_way_refuses_that_hello() -> None:
    gate: ConnectionGate[str] = ConnectionGate(LIMITS)
    for name in ("a", "b", "c"):
        assert gate.admit(name, "10.0.0.1" if name != "c" else "10.0.0.2").admitted
    assert gate.authenticate("a") is None and gate.authenticate("b") is None
    assert gate.authenticate("c") == "too many connections"
    gate.release("c")
    assert len(gate) == 2


def test_limits_refuse_nonsense() -> None:
    with pytest.raises(ValueError):
        dataclasses.replace(LIMITS, max_unauthenticated=0)
    with pytest.raises(ValueError):
        dataclasses.replace(LIMITS, read_timeout=0.0)


def test_keepalive_is_switched_on_with_the_timing_the_platform_lets_us_set() -> None:
    options = keepalive_options(60, 10, 6)
    assert (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1) in options
    with socket.create_server(("127.0.0.1", 0)) as server:
        with socket.create_connection(server.getsockname()) as client:
            set_keepalive(client, LIMITS.keepalive)
            assert client.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            if hasattr(socket, "TCP_KEEPIDLE"):
                assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 60
                assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 6
    set_keepalive(object(), LIMITS.keepalive)  # not a socket: left alone, no error


# ------------------------------------------------------------------ ServerReader

STREAM_BUFFER = 8  # bytes of a body read before the budget is asked


async def _accepted_reader(
    payload: bytes, budget: ByteBudget
) -> tuple[ServerReader, asyncio.StreamWriter, asyncio.StreamWriter]:
    """A ServerReader over a real loopback connection whose peer passed its hello and
    then wrote ``payload``; the two writers are returned to be closed."""
    accepted: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await accepted.put((reader, writer))

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _, client = await asyncio.open_connection("127.0.0.1", port)
    reader, writer = await accepted.get()
    server.close()
    conn = ServerConnection(None)
    conn.send_challenge()
    mac = auth.hello_mac(None, conn.nonce, messages.ROLE_RELAY, "r")
    hello = messages.hello(role=messages.ROLE_RELAY, sender="r", session="s", identity={}, mac=mac)
    client.write(encode_frame(hello) + payload)
    frames = ServerReader(reader, conn, budget, LIMITS, stream_buffer=STREAM_BUFFER)
    (event,) = await frames.first_frame() or [None]
    assert isinstance(event, Hello)
    conn.send_accept()
    return frames, client, writer


def test_a_frame_that_stalls_mid_body_is_cut_and_its_bytes_are_given_back() -> None:
    async def go() -> None:
        budget = ByteBudget(LIMITS.inbound_bytes)
        # A header declaring 900 bytes, ten of them sent, then nothing.
        frames, client, writer = await _accepted_reader(struct.pack(">I", 900) + b"x" * 10, budget)
        with pytest.raises(ReadTimeout, match="900 bytes"):
            async with frames.frame():
                raise AssertionError("no events from a frame that never completes")
        assert budget.peak_bytes == 904  # reserved once its first bytes came ...
        assert budget.bytes_held == 0  # ... and given back with the frame
        client.close()
        writer.close()

    asyncio.run(go())


def test_a_frame_that_stalls_before_its_first_bytes_never_holds_budget() -> None:
    async def go() -> None:
        budget = ByteBudget(LIMITS.inbound_bytes)
        # A header declaring 900 bytes and fewer than a stream buffer's worth of them.
        frames, client, writer = await _accepted_reader(struct.pack(">I", 900) + b"x" * 5, budget)
        with pytest.raises(ReadTimeout, match="900 bytes"):
            async with frames.frame():
                raise AssertionError("no events from a frame that never completes")
        assert budget.peak_bytes == 0 and budget.waits == 0  # nobody ever waited on it
        client.close()
        writer.close()

    asyncio.run(go())


def test_an_authenticated_peer_that_sends_nothing_is_cut_after_the_idle_timeout() -> None:
    async def go() -> None:
        budget = ByteBudget(LIMITS.inbound_bytes)
        frames, client, writer = await _accepted_reader(b"", budget)
        with pytest.raises(IdleTimeout):
            async with frames.frame():
                raise AssertionError("no frame came")
        assert budget.bytes_held == 0
        client.close()
        writer.close()

    asyncio.run(go())


def test_waiting_for_the_budget_is_not_counted_against_the_peer() -> None:
    async def go() -> None:
        budget = ByteBudget(LIMITS.inbound_bytes)
        ack = messages.relay_batch(1, [], {}, {}, {})
        frames, client, writer = await _accepted_reader(encode_frame(ack), budget)
        async def take() -> list[Event] | None:
            async with frames.frame() as events:
                return events

        async with budget.hold(LIMITS.inbound_bytes):  # another connection holds it all
            reading = asyncio.ensure_future(take())
            await asyncio.sleep(LIMITS.read_timeout * 3)
            assert not reading.done()  # still waiting for bytes, not timed out
        events = await reading
        assert events is not None and isinstance(events[0], RelayBatch) and events[0].seq == 1
        assert budget.bytes_held == 0
        client.close()
        writer.close()

    asyncio.run(go())


# ------------------------------------------------------------------ LineLimiter


def test_repeated_lines_come_once_then_once_an_interval_with_what_was_held_back() -> None:
    now = [0.0]
    lines = LineLimiter(60.0, clock=lambda: now[0])
    assert lines.line("refused", "refused: bad token") == "refused: bad token"
    for _ in range(5):
        now[0] += 1.0
        assert lines.line("refused", "refused: bad token") is None
    assert lines.line("other", "something else") == "something else"  # kinds are counted apart
    assert lines.held_back("refused") == 5
    now[0] = 61.0
    assert lines.line("refused", "refused: bad token") == (
        "refused: bad token (and 5 more like it since the last such line)"
    )
    now[0] = 200.0
    assert lines.line("refused", "refused: bad token") == "refused: bad token"  # nothing held back meanwhile
