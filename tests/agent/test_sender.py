"""The sender thread against a real TCP relay stand-in with the real framing."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from agent import sender as sender_mod
from agent.errors import ErrorReporter
from agent.sender import HelloInfo, ResendBuffer, Sender, encode_bodies
from tests.agent.fake_relay import FakeRelay
from traceml_wire.auth import hello_mac
from traceml_wire.partials import decode_partials
from traceml_wire.tables import decode_batch, decode_body

HELLO = HelloInfo(sender="s1/a0/n0/r0/1-abc", session="s1", identity={"global_rank": 0, "pid": 1})


class CountingSource:
    """One status row per flush; remembers whether the final flush happened."""

    def __init__(self) -> None:
        self.flushes = 0
        self.final = False

    def build(self, now: float, *, final: bool) -> dict[str, dict[str, list[Any]]]:
        self.flushes += 1
        self.final = self.final or final
        return {"status": {"ts": [now], "phase": ["idle"], "steps_done": [self.flushes], "finished": [int(final)]}}


def make_sender(
    port: int,
    *,
    token: str | None = None,
    buffer_bytes: int = 1 << 20,
    reporter: ErrorReporter | None = None,
    source: CountingSource | None = None,
) -> Sender:
    src = source or CountingSource()
    return Sender(
        source=lambda: src,
        hello=lambda final: HELLO,
        host="127.0.0.1",
        port=port,
        token=token,
        flush_s=0.02,
        buffer_bytes=buffer_bytes,
        reporter=reporter or ErrorReporter(),
    )


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    # Keep reconnects quick so the tests observe several of them.
    monkeypatch.setattr(sender_mod, "BACKOFF_MAX_S", 0.05)
    monkeypatch.setattr(sender_mod, "BACKOFF_MIN_S", 0.01)


def test_handshake_and_numbered_batches(make_relay: Any) -> None:
    relay: FakeRelay = make_relay(token="s3cret")
    source = CountingSource()
    sender = make_sender(relay.port, token="s3cret", source=source)
    sender.start()
    assert relay.wait_for(lambda: len(relay.batches) >= 5)
    assert sender.stop(2.0)
    hello = relay.hellos[0]
    assert hello["role"] == "agent" and hello["sender"] == HELLO.sender and hello["session"] == "s1"
    assert hello["identity"]["global_rank"] == 0
    seqs = relay.seqs()
    assert seqs == list(range(1, len(seqs) + 1))
    tables = decode_body(relay.batches[0][2])
    assert tables["status"]["phase"] == ["idle"]
    # The final flush went out, was acked, and the stream closed with bye.
    assert source.final
    assert decode_body(relay.batches[-1][2])["status"]["finished"] == [1]
    assert sender.acked == sender.seq == seqs[-1]
    assert len(sender.buffer) == 0
    assert relay.wait_for(lambda: relay.byes == 1)


def test_resend_after_drop_without_ack(fake_relay: FakeRelay) -> None:
    fake_relay.drop_after = 3  # first connection: take 3 batches, ack none, hang up
    fake_relay.ack = False
    sender = make_sender(fake_relay.port)
    sender.start()
    assert fake_relay.wait_for(lambda: fake_relay.connections >= 1 and len(fake_relay.seqs(1)) >= 3)
    fake_relay.drop_after = None
    fake_relay.ack = True
    assert fake_relay.wait_for(lambda: len(fake_relay.seqs(2)) >= 5)
    assert sender.stop(2.0)
    first, second = fake_relay.seqs(1), fake_relay.seqs(2)
    assert first == [1, 2, 3]
    # Nothing was acked, so the second connection starts again at 1, in order.
    assert second[:3] == [1, 2, 3]
    assert second == list(range(1, len(second) + 1))


def test_reconnect_skips_what_the_relay_already_holds(fake_relay: FakeRelay) -> None:
    sender = make_sender(fake_relay.port)
    sender.start()
    assert fake_relay.wait_for(lambda: len(fake_relay.seqs(1)) >= 2)
    fake_relay.drop_after = 1  # the next connection hangs up after one more batch, unacked
    fake_relay.ack = False
    # Hang up on the current connection by closing its socket from the server side.
    for conn in list(fake_relay._conns):
        conn.close()
    assert fake_relay.wait_for(lambda: fake_relay.connections >= 3)
    fake_relay.drop_after = None
    fake_relay.ack = True
    assert fake_relay.wait_for(lambda: len(fake_relay.seqs(fake_relay.connections)) >= 2)
    assert sender.stop(2.0)
    held_before = max(fake_relay.seqs(1))
    last_conn = fake_relay.connections
    resent = fake_relay.seqs(last_conn)
    # accept.last_seq covered what was acked, so the resend starts just above it.
    assert resent[0] > 1
    assert resent == list(range(resent[0], resent[0] + len(resent)))
    all_seqs = set(fake_relay.seqs())
    assert set(range(1, held_before + 1)) <= all_seqs


def test_buffer_cap_drops_oldest_and_counts(fake_relay: FakeRelay) -> None:
    fake_relay.mode = "hangup"  # listening, but every connection dies before the challenge
    frame_size = len(sender_mod.encode_frame({"t": "batch", "seq": 1, "body": encode_bodies(
        CountingSource().build(0.0, final=False), 0.0)[0][0]}))
    sender = make_sender(fake_relay.port, buffer_bytes=frame_size * 3)
    sender.start()
    assert fake_relay.wait_for(lambda: sender.buffer.dropped_batches >= 3)
    fake_relay.mode = "normal"
    assert fake_relay.wait_for(lambda: len(fake_relay.batches) >= 2)
    assert sender.stop(2.0)
    seqs = fake_relay.seqs()
    assert seqs[0] > 1  # the oldest batches were dropped, not the newest
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert sender.buffer.dropped_bytes >= frame_size * sender.buffer.dropped_batches // 2


def test_refusal_reported_once(fake_relay: FakeRelay, capsys: pytest.CaptureFixture[str]) -> None:
    fake_relay.mode = "refuse"
    fake_relay.refuse_reason = "session mismatch"
    reporter = ErrorReporter()
    sender = make_sender(fake_relay.port, reporter=reporter)
    sender.start()
    assert fake_relay.wait_for(lambda: len(fake_relay.hellos) >= 3)
    assert sender.stop(1.0)
    err = capsys.readouterr().err
    assert err.count("[traceml] relay refused: session mismatch") == 1
    assert reporter.counts["refused"] >= 3
    assert "Traceback" not in err


def test_a_relay_that_keeps_refusing_is_said_once_then_once_a_minute_with_the_count(
    fake_relay: FakeRelay, capsys: pytest.CaptureFixture[str]
) -> None:
    # The refusal reason comes from whatever holds the port: it reaches stderr escaped.
    fake_relay.mode = "refuse"
    fake_relay.refuse_reason = "go away\x1b[2J\nFAKE"
    sender = make_sender(fake_relay.port)
    now = [1000.0]
    sender._lines._clock = lambda: now[0]  # the minute passes when the test says so
    sender.start()
    assert fake_relay.wait_for(lambda: len(fake_relay.hellos) >= 3)
    first = capsys.readouterr().err
    assert first.count("[traceml] relay refused:") == 1 and "go away\\x1b[2J\\x0aFAKE" in first, first
    assert "\x1b" not in first
    now[0] += 61.0
    seen = len(fake_relay.hellos)
    assert fake_relay.wait_for(lambda: len(fake_relay.hellos) >= seen + 2)
    assert sender.stop(1.0)
    lines = [line for line in capsys.readouterr().err.splitlines() if "relay refused" in line]
    assert len(lines) == 1 and "more like it since the last such line" in lines[0], lines


def test_wrong_token_is_refused(make_relay: Any, capsys: pytest.CaptureFixture[str]) -> None:
    relay: FakeRelay = make_relay(token="right")
    sender = make_sender(relay.port, token="wrong")
    sender.start()
    assert relay.wait_for(lambda: len(relay.hellos) >= 1)
    assert sender.stop(1.0)
    assert relay.batches == []
    assert "[traceml] relay refused: bad token" in capsys.readouterr().err


@pytest.mark.parametrize("proof", ["forged", "absent"])
def test_a_relay_port_held_without_the_token_gets_nothing_and_one_line(
    make_relay: Any, capsys: pytest.CaptureFixture[str], proof: str
) -> None:
    squatter: FakeRelay = make_relay(token=None)
    squatter.mode = "squat"
    squatter.squat_proof = b"\x00" * 32 if proof == "forged" else None
    reporter = ErrorReporter()
    sender = make_sender(squatter.port, token="s3cret", reporter=reporter)
    sender.start()
    assert squatter.wait_for(lambda: len(squatter.hellos) >= 3)  # it keeps trying, in case the relay comes
    assert sender.stop(1.0)
    assert squatter.batches == [] and squatter.byes == 0
    err = capsys.readouterr().err
    assert err.count("[traceml]") == 1 and "could not prove it holds TRACEML_TOKEN" in err, err
    assert "s3cret" not in err
    assert reporter.counts["unverified-relay"] >= 3
    assert len(sender.buffer) == sender.seq and sender.acked == 0  # kept, not sent


def test_unreachable_warns_once_and_stop_is_bounded(capsys: pytest.CaptureFixture[str]) -> None:
    # Bound but not listening: connects are refused, and no one else can take the port.
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        sender = make_sender(unused.getsockname()[1])
        sender.start()
        assert not sender.finished.wait(0.3)  # keeps running, buffering, retrying
        assert sender.stop(0.5)
    err = capsys.readouterr().err
    assert err.count("[traceml]") == 1 and "unreachable" in err
    assert sender.seq >= 2 and len(sender.buffer) == sender.seq


def test_stalled_relay_does_not_hang_stop(fake_relay: FakeRelay) -> None:
    fake_relay.mode = "silent"  # accepts TCP, never sends the challenge
    sender = make_sender(fake_relay.port)
    sender.start()
    assert fake_relay.wait_for(lambda: fake_relay.connections >= 1)
    assert sender.stop(0.5)


def test_resend_buffer_release_and_after() -> None:
    buf = ResendBuffer(max_bytes=10)
    for seq in range(1, 6):
        buf.push(seq, b"abcd")  # 4 bytes each: only two fit under 10
    assert [s for s, _ in buf.after(0)] == [4, 5]
    assert buf.dropped_batches == 3 and buf.dropped_bytes == 12
    buf.release(4)
    assert [s for s, _ in buf.after(0)] == [5] and buf.bytes == 4
    buf.push(6, b"x" * 50)  # a frame over the cap alone is still kept (newest wins)
    assert [s for s, _ in buf.after(0)] == [6]


def test_encode_bodies_splits_under_the_frame_limit() -> None:
    n = 2000
    tables = {"scalars": {"step": list(range(n)), "name": ["loss"] * n, "value": [0.5] * n}}
    bodies, dropped = encode_bodies(tables, 1.0, limit=4096)
    assert len(bodies) > 1 and all(len(b) <= 4096 for b in bodies) and dropped == 0
    steps = [s for b in bodies for s in decode_body(b)["scalars"]["step"]]
    assert steps == list(range(n))


def test_each_split_body_carries_the_history_partials_of_its_own_steps() -> None:
    from agent.recorder import Recorder

    rec = Recorder()
    for step in range(3000):
        rec.add("steps", {"step": step, "ts": 1.0 + step, "step_ns": 10_000 + step, "forward_ns": 4_000,
                          "backward_ns": 5_000, "optimizer_ns": 1_000, "wait_ns": step % 7})
    bodies, dropped = encode_bodies(rec.drain(), 1.0, limit=64 * 1024)
    assert len(bodies) > 1 and dropped == 0
    counted = 0
    for body in bodies:
        tables, raw = decode_batch(body)
        fine = decode_partials(raw, tables["steps"][0])  # the daemon's check passes
        counted += sum(stats[0] for _, stats in fine)
    assert counted == 3000


def _span(args: str) -> dict[str, list[Any]]:
    return {"name": ["big"], "start_ns": [1], "dur_ns": [2], "step": [0], "args": [args]}


def test_encode_bodies_counts_a_single_row_over_the_limit() -> None:
    tables = {"spans": _span("x" * 5000), "scalars": {"step": [0, 1, 2], "name": ["loss"] * 3, "value": [0.5] * 3}}
    bodies, dropped = encode_bodies(tables, 1.0, limit=4096)
    assert dropped == 1  # the span cannot travel; everything else does
    assert [s for b in bodies for s in decode_body(b)["scalars"]["step"]] == [0, 1, 2]
    assert all("spans" not in decode_body(b) for b in bodies)


def test_encode_bodies_separates_one_row_tables_that_only_fit_apart() -> None:
    # Two one-row tables, each under the limit, together over it: halving rows cannot
    # split them (this recursed without end before).
    tables = {"spans": _span("x" * 3000), "scalars": {"step": [7], "name": ["n" * 3000], "value": [1.0]}}
    bodies, dropped = encode_bodies(tables, 1.0, limit=4096)
    assert dropped == 0 and len(bodies) == 2
    decoded = [decode_body(b) for b in bodies]
    assert sorted(t for d in decoded for t in d) == ["scalars", "spans"]


class OversizeOnce(CountingSource):
    """A source with its own counter in every flush; the first also carries one span
    too large for any batch."""

    def build(self, now: float, *, final: bool) -> dict[str, dict[str, list[Any]]]:
        tables = super().build(now, final=final)
        tables["drops"] = {"ts": [now], "source": ["recorder_rows"], "count": [0]}
        if self.flushes == 1:
            tables["spans"] = _span("x" * 8192)
        return tables


def test_oversize_row_is_counted_and_shipped_as_a_drop(fake_relay: FakeRelay, capsys: pytest.CaptureFixture[str]) -> None:
    source = OversizeOnce()
    sender = make_sender(fake_relay.port, source=source)
    sender.max_body_bytes = 4096
    sender.start()
    assert fake_relay.wait_for(lambda: len(fake_relay.batches) >= 4)
    assert sender.stop(2.0)
    tables = [decode_body(body) for _, _, body in fake_relay.batches]
    assert all("spans" not in t for t in tables)
    reported = [
        dict(zip(t["drops"]["source"], t["drops"]["count"], strict=True)) for t in tables if "drops" in t
    ]
    # Shipped in the flush that lost the row (beside the source's own counters)...
    assert reported[0] == {"recorder_rows": 0} and reported[1] == {"sender_oversize_rows": 1}
    # ...and repeated in every later flush, as the cumulative counters are.
    assert len(reported) > 3
    assert all(r == {"recorder_rows": 0, "sender_oversize_rows": 1} for r in reported[2:])
    assert sender.oversize_rows == 1
    assert capsys.readouterr().err.count("larger than one batch") == 1


def test_hello_mac_matches_token() -> None:
    # Guard against the agent and the fake relay drifting apart on the MAC input.
    assert hello_mac("t", b"n" * 16, "agent", "x") != hello_mac("u", b"n" * 16, "agent", "x")


class DeviceSource(CountingSource):
    """A source whose tracer times steps with device events (or not): counts resolve() calls."""

    def __init__(self, device: bool, fail: bool = False) -> None:
        super().__init__()
        self.resolves_device = device
        self.resolves = 0
        self.fail = fail

    def resolve(self) -> None:
        self.resolves += 1
        if self.fail:
            raise RuntimeError("resolve broke")


def _quiet_sender(relay_port: int, source: CountingSource, flush_s: float) -> Sender:
    sender = make_sender(relay_port, source=source)
    sender.flush_s = flush_s
    sender.resolve_s = 0.01
    return sender


def test_device_events_are_resolved_between_flushes(fake_relay: FakeRelay) -> None:
    # One flush a minute: only the between-flush resolution can refill the event pool.
    source = DeviceSource(device=True)
    sender = _quiet_sender(fake_relay.port, source, flush_s=60.0)
    sender.start()
    assert fake_relay.wait_for(lambda: source.resolves >= 5)
    assert source.flushes == 0
    assert sender.stop(2.0)
    assert source.final  # the final flush still went out


def test_a_host_only_source_is_never_resolved(fake_relay: FakeRelay) -> None:
    source = DeviceSource(device=False)
    sender = _quiet_sender(fake_relay.port, source, flush_s=0.02)
    sender.start()
    assert fake_relay.wait_for(lambda: source.flushes >= 5)
    assert sender.stop(2.0)
    assert source.resolves == 0  # a CPU run wakes once per flush, not every resolve_s


def test_a_failing_resolve_is_reported_and_sending_goes_on(fake_relay: FakeRelay,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    source = DeviceSource(device=True, fail=True)
    sender = _quiet_sender(fake_relay.port, source, flush_s=0.05)
    sender.start()
    assert fake_relay.wait_for(lambda: source.resolves >= 3 and len(fake_relay.batches) >= 3)
    assert sender.stop(2.0)
    assert fake_relay.connections == 1  # the link was not dropped for it
    assert "device event resolution failed" in capsys.readouterr().err
