"""The background sender: batches telemetry once per flush and ships it.

Runs on one daemon thread per process with blocking sockets and timeouts (no
asyncio in the training process). Each flush drains the recorder into one
numbered batch (seq 1, 2, 3 ...) kept in a byte-capped resend buffer until
the relay acknowledges it; acks are cumulative. After a reconnect the relay's
``accept.last_seq`` says what it already holds, the rest is resent in order.
Reconnects back off exponentially with jitter, so a dead relay costs one
failed loopback connect every few seconds and nothing on the training thread.
"""

from __future__ import annotations

import math
import random
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from agent.errors import PREFIX, ErrorReporter
from agent.link import IO_TIMEOUT_S, Cancelled, HelloInfo, Link, Refused, Unverified
from traceml_wire import messages
from traceml_wire.body import encode_body
from traceml_wire.connection_events import Control
from traceml_wire.errors import ProtocolError
from traceml_wire.framing import MAX_AGENT_BODY_BYTES, encode_frame
from traceml_wire.printable import printable
from traceml_wire.ratelimit import LineLimiter

BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 5.0
# The wire module derives it from the daemon's frame cap: the relay accepts every
# body up to it, and one alone in an rbatch still fits the daemon's cap.
MAX_BODY_BYTES = MAX_AGENT_BODY_BYTES
# "drops" source of rows that could not be sent at all: one row alone over MAX_BODY_BYTES.
OVERSIZE_ROWS = "sender_oversize_rows"

Tables = dict[str, dict[str, list[Any]]]


class ResendBuffer:
    """Unacknowledged batch frames in seq order, capped in bytes.

    Past the cap the oldest frames go first (the newest data is the most
    useful for a live view) and every drop is counted.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: deque[tuple[int, bytes]] = deque()
        self.bytes = 0
        self.dropped_batches = 0
        self.dropped_bytes = 0

    def push(self, seq: int, frame: bytes) -> None:
        self._items.append((seq, frame))
        self.bytes += len(frame)
        # Keep at least the newest frame even if it alone exceeds the cap.
        while self.bytes > self.max_bytes and len(self._items) > 1:
            _, old = self._items.popleft()
            self.bytes -= len(old)
            self.dropped_batches += 1
            self.dropped_bytes += len(old)

    def release(self, upto: int) -> None:
        """Forget every frame with seq <= ``upto`` (a cumulative ack)."""
        while self._items and self._items[0][0] <= upto:
            _, frame = self._items.popleft()
            self.bytes -= len(frame)

    def after(self, seq: int) -> Iterator[tuple[int, bytes]]:
        return ((s, f) for s, f in list(self._items) if s > seq)

    def __len__(self) -> int:
        return len(self._items)


class BatchSource(Protocol):
    """What the sender drains each flush (the runtime's batch builder).

    A source may also have ``resolves_device`` (a bool attribute or property) and
    ``resolve()``: while ``resolves_device`` is true, the sender calls ``resolve()``
    every ``RESOLVE_S`` between flushes (see ``Sender._run``)."""

    def build(self, now: float, *, final: bool) -> Tables: ...


def _row_count(cols: dict[str, list[Any]]) -> int:
    return len(next(iter(cols.values()), []))


def encode_bodies(tables: Tables, now: float, limit: int = MAX_BODY_BYTES) -> tuple[list[bytes], int]:
    """Bodies of at most ``limit`` bytes holding the rows of ``tables``, and how many
    rows could not be sent: a row whose body alone is over ``limit`` (the caller counts it).

    Oversize bodies are split in halves until they fit; every split makes progress,
    so this ends even for several one-row tables that only fit apart.
    """
    body = encode_body(tables, sent_ts=now)
    if len(body) <= limit:
        return [body], 0
    sizes = {name: n for name, cols in tables.items() if (n := _row_count(cols))}
    if sum(sizes.values()) <= 1:
        return [], sum(sizes.values())  # a single row over the frame cap cannot be sent at all
    first: Tables = {}
    second: Tables = {}
    if max(sizes.values()) > 1:
        # Halve every table with several rows; one-row tables ride in the first half,
        # which still shrinks because some table lost half its rows.
        for name, n in sizes.items():
            cols, half = tables[name], n // 2 if n > 1 else n
            first[name] = {c: v[:half] for c, v in cols.items()}
            second[name] = {c: v[half:] for c, v in cols.items()}
    else:
        # Several one-row tables: halving rows cannot split them; split the tables.
        names = list(sizes)
        for i, name in enumerate(names):
            (first if i < len(names) // 2 else second)[name] = tables[name]
    bodies, dropped = encode_bodies(first, now, limit)
    more, dropped_more = encode_bodies(second, now, limit)
    return bodies + more, dropped + dropped_more


def _drop_row(now: float, count: int) -> dict[str, list[Any]]:
    return {"ts": [now], "source": [OVERSIZE_ROWS], "count": [count]}


def _add_drop(tables: Tables, now: float, count: int) -> None:
    """Append the OVERSIZE_ROWS counter to the flush's "drops" table (drained: ours to change)."""
    row = _drop_row(now, count)
    drops = tables.get("drops")
    if not drops or not _row_count(drops):
        tables["drops"] = row
        return
    width = _row_count(drops)
    for column in ("ts", "source", "count"):
        drops.setdefault(column, [None] * width).extend(row[column])
    for column, values in drops.items():
        if column not in row:
            values.append(None)


# Device timing events are resolved this often between flushes. A traced step records
# ten CUDA events and the pool holds 8192 (agent.capture.events), so resolving once per
# one-second flush left every step after the ~819th of each second without device timings
# (counted as device_steps_fallback) whenever steps were shorter than ~1.2 ms. Resolving
# every 50 ms keeps the pool refilled down to ~6 us steps; the work is the same in total
# (one query per event), only spread out.
RESOLVE_S = 0.05


class Sender:
    """The sender thread: flush, number, buffer, send, resend, back off."""

    def __init__(
        self,
        *,
        source: Callable[[], BatchSource | None],
        hello: Callable[[bool], HelloInfo | None],
        host: str,
        port: int,
        token: str | None,
        flush_s: float,
        buffer_bytes: int,
        reporter: ErrorReporter,
        prepare: Callable[[], None] | None = None,
        on_reconnect: Callable[[], None] | None = None,
        on_control: Callable[[Control], None] | None = None,
    ) -> None:
        self._source_factory = source
        self._hello_factory = hello
        self.host, self.port = host, port
        self._token = token
        self.flush_s = flush_s
        self.resolve_s = RESOLVE_S
        self.buffer = ResendBuffer(buffer_bytes)
        self._reporter = reporter
        self._prepare = prepare
        self._on_reconnect = on_reconnect
        self._on_control = on_control  # a request the relay passed down (agent.control)
        self._wake = threading.Event()
        self._stop_requested = False
        self._stop_deadline = 0.0
        self._thread: threading.Thread | None = None
        self._link: Link | None = None
        self._hello: HelloInfo | None = None  # fixed once a relay accepted it
        self._sent_upto = 0  # highest seq written on the current link
        self._backoff = BACKOFF_MIN_S
        self._next_connect = 0.0
        self.seq = 0
        self.acked = 0
        self.connects = 0
        self.disconnects = 0
        self.refusals = 0
        # A relay that keeps refusing would print a line per retry on the trainer's stderr.
        self._lines = LineLimiter()
        # Rows that could not be sent at all (one row over MAX_BODY_BYTES): a real loss,
        # shipped as the "drops" source OVERSIZE_ROWS with every flush once non-zero.
        self.oversize_rows = 0
        self.max_body_bytes = MAX_BODY_BYTES
        self.finished = threading.Event()

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="traceml-sender", daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> bool:
        """Final flush, wait for acks, close; bounded by ``timeout``. True if clean."""
        self._stop_deadline = time.monotonic() + timeout
        self._stop_requested = True
        self._wake.set()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return False
        thread.join(timeout + 0.2)  # the loop honours the deadline itself
        return not thread.is_alive()

    def poke(self) -> None:
        """Wake the thread now (identity settled: the first hello may go out)."""
        self._next_connect = 0.0
        self._wake.set()

    # ------------------------------------------------------------ the loop

    def _run(self) -> None:
        source: BatchSource | None = None
        try:
            if self._prepare is not None:
                self._prepare()
            source = self._source_factory()
        except Exception as exc:
            self._reporter.report("sender-start", f"telemetry sampler setup failed: {exc!r}")
        next_flush = time.monotonic() + self.flush_s
        # Only a source with device events wants resolving between flushes; a host-only
        # run wakes once per flush. Decided again after every flush: the tracer and its
        # backend are settled lazily, at the first traced step.
        next_resolve = self._next_resolve(source, time.monotonic())
        while not self._stop_requested:
            now = time.monotonic()
            wait = min(next_flush, next_resolve) - now
            if self._link is None and len(self.buffer):
                wait = min(wait, self._next_connect - now)
            self._wake.wait(max(0.0, wait))
            self._wake.clear()
            if self._stop_requested:
                break
            try:
                now = time.monotonic()
                if now >= next_flush:
                    next_flush = max(next_flush + self.flush_s, now)
                    self._flush(source, final=False)
                    next_resolve = self._next_resolve(source, now)
                elif now >= next_resolve:
                    self._resolve(source)
                    next_resolve = self._next_resolve(source, now)
                self._pump(final=False)
            except Exception as exc:  # a bug here must not kill telemetry for the run
                self._reporter.report("sender-loop", f"telemetry sender error: {exc!r}")
                self._drop_link()
        try:
            self._flush(source, final=True)
            self._pump(final=True)
        except Exception as exc:
            self._reporter.report("sender-loop", f"telemetry sender error at shutdown: {exc!r}")
        finally:
            if self._link is not None:
                self._link.close(bye=True)
                self._link = None
            self.finished.set()

    def _next_resolve(self, source: BatchSource | None, now: float) -> float:
        """When to resolve device events next: ``inf`` for a source without them."""
        try:
            wanted = bool(getattr(source, "resolves_device", False))
        except Exception:
            wanted = False
        return now + self.resolve_s if wanted else math.inf

    def _resolve(self, source: BatchSource | None) -> None:
        try:
            resolve = getattr(source, "resolve", None)
            if resolve is not None:
                resolve()
        except Exception as exc:  # its own error, not the link's: keep sending
            self._reporter.report("sender-resolve", f"device event resolution failed: {exc!r}")

    def _flush(self, source: BatchSource | None, *, final: bool) -> None:
        if source is None:
            return
        now = time.time()
        tables = source.build(now, final=final)
        if not tables:
            return
        if self.oversize_rows:
            # Repeated every flush like the other counters: a batch carrying it may be
            # evicted from the resend buffer, and the daemon keeps the maximum anyway.
            _add_drop(tables, now, self.oversize_rows)
        bodies, dropped = encode_bodies(tables, now, self.max_body_bytes)
        if dropped:
            self.oversize_rows += dropped
            self._reporter.report(
                "oversize-row",
                f"a telemetry row is larger than one batch ({self.max_body_bytes} bytes) and was dropped (counted)",
            )
            # Ship the new count in this flush: at shutdown there is no next one.
            bodies += encode_bodies({"drops": _drop_row(now, self.oversize_rows)}, now, self.max_body_bytes)[0]
        for body in bodies:
            self.seq += 1
            self.buffer.push(self.seq, encode_frame(messages.batch(self.seq, body)))

    def _remaining(self) -> float:
        return self._stop_deadline - time.monotonic()

    def _pump(self, *, final: bool) -> None:
        """Connect if due, send what the relay lacks, collect acks."""
        if self._link is None:
            if not len(self.buffer):
                return
            if not final and time.monotonic() < self._next_connect:
                return
            if final and self._remaining() <= 0.05:
                return
            self._connect(final)
            if self._link is None:
                return
        link = self._link
        if final:
            link.io_timeout = max(0.05, min(IO_TIMEOUT_S, self._remaining()))
        try:
            for seq, frame in self.buffer.after(self._sent_upto):
                link.send(link.conn.send_encoded(seq, frame))
                self._sent_upto = seq
            if final:
                # Wait for the relay to hold everything, within the deadline.
                while self.acked < self.seq and self._remaining() > 0:
                    self._ack(link.read_acks(min(0.05, max(0.0, self._remaining()))))
            else:
                self._ack(link.read_acks(0.0))
            self._take_controls(link)
        except Refused as exc:
            self._on_refused(str(exc))
            self._drop_link()
        except (OSError, ProtocolError):
            self.disconnects += 1
            self._reporter.count("disconnect")
            self._drop_link()

    def _ack(self, seq: int) -> None:
        if seq > self.acked:
            self.acked = seq
            self.buffer.release(seq)

    def _connect(self, final: bool) -> None:
        hello = self._hello or self._hello_factory(final)
        if hello is None:
            # Identity not settled yet: keep the first hello back. poke() (the
            # first trace_step) brings the next try forward; never spin.
            self._next_connect = time.monotonic() + self.flush_s
            return
        timeout = IO_TIMEOUT_S if not final else max(0.05, min(IO_TIMEOUT_S, self._remaining()))
        try:
            link, last_seq = Link.open(
                self.host,
                self.port,
                token=self._token,
                hello=hello,
                timeout=timeout,
                # Only the loop's connects give way to stop(); the final one has its own deadline.
                cancel=(lambda: self._stop_requested) if not final else (lambda: self._remaining() <= 0),
            )
        except Refused as exc:
            self._on_refused(str(exc))
            self._schedule_retry(BACKOFF_MAX_S)
            return
        except Unverified as exc:
            # Something holds the relay port but not the token: not one batch goes there.
            self._reporter.report(
                "unverified-relay",
                f"the process on relay port {self.host}:{self.port} could not prove it holds TRACEML_TOKEN ({exc}); "
                "telemetry is not sent to it, kept and retried",
            )
            self._schedule_retry(BACKOFF_MAX_S)
            return
        except Cancelled:
            return  # the final flush reconnects within its own deadline
        except (OSError, ProtocolError) as exc:
            self._reporter.report(
                "connect",
                f"relay at {self.host}:{self.port} unreachable ({exc.__class__.__name__}); training continues, "
                f"telemetry is kept (up to {self.buffer.max_bytes // (1024 * 1024)} MiB) and sent when it is back",
            )
            self._schedule_retry(self._backoff)
            self._backoff = min(BACKOFF_MAX_S, self._backoff * 2)
            return
        self._hello = hello
        self._link = link
        self.connects += 1
        if self.connects > 1 and self._on_reconnect is not None:
            self._on_reconnect()
        self._backoff = BACKOFF_MIN_S
        self._ack(last_seq)
        # Everything above the relay's high-water mark goes again, in order.
        self._sent_upto = max(last_seq, self.acked)

    def _take_controls(self, link: Link) -> None:
        """Hand the requests the relay passed down to the runtime (this thread; never the training one)."""
        if link.controls_refused:
            for _ in range(link.controls_refused):
                self._reporter.count("control-refused")
            link.controls_refused = 0
        while link.controls:
            control = link.controls.popleft()
            if self._hello is None or control.sender != self._hello.sender:
                self._reporter.count("control-misrouted")  # meant for another rank: never acted on
                continue
            if self._on_control is not None:
                try:
                    self._on_control(control)
                except Exception as exc:  # a request gone wrong must not stop telemetry
                    self._reporter.report("control", f"control request {control.op!r} failed: {exc!r}")

    def _schedule_retry(self, delay: float) -> None:
        # Jitter spreads the reconnects of many ranks after a relay restart.
        self._next_connect = time.monotonic() + delay * random.uniform(0.5, 1.0)

    def _on_refused(self, reason: str) -> None:
        self.refusals += 1
        self._reporter.count("refused")
        line = self._lines.line("refused", f"relay refused: {printable(reason)}")
        if line is not None:
            try:
                sys.stderr.write(f"{PREFIX} {line}\n")
                sys.stderr.flush()
            except Exception:  # a closed or odd stderr must not stop the sender
                pass
        self._schedule_retry(BACKOFF_MAX_S)

    def _drop_link(self) -> None:
        if self._link is not None:
            self._link.close(bye=False)
            self._link = None
        self._sent_upto = self.acked
        if self._next_connect <= time.monotonic():
            self._schedule_retry(self._backoff)
            self._backoff = min(BACKOFF_MAX_S, self._backoff * 2)
