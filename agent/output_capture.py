"""The rank's stdout and stderr, captured at the file descriptor and passed through.

``OutputCapture.start()`` points fds 1 and 2 at pipes (``os.dup2``), so Python
prints and native writes (NCCL, C++ warnings, child processes) all land there.
One reader thread copies every chunk to the original descriptor first,
unchanged and in order, then cuts it into lines for the sender thread. The
console path never waits on anything but the console itself: lines go to a
bounded buffer (a byte cap, a line-rate bucket), and what does not fit is
dropped and counted, never waited for. ``stop()`` restores the original
descriptors and reads what is still in the pipes (a traceback printed at exit).
Children that inherited a pipe (DataLoader workers, subprocesses) may write on
after that: the reader keeps copying their bytes to the console, uncaptured,
until the last of them closes it, so none of them ever blocks on a full pipe or
dies of a closed one.

A process killed outright (abort, a fatal signal) takes with it what the reader
had not copied yet; Python's fault handler, when enabled, writes to the original
stderr directly, so a crash's traceback reaches the console whatever the pipe holds.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import select
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

STREAMS = {1: "stdout", 2: "stderr"}
DEFAULT_LINES_PER_S = 20_000.0
DEFAULT_BURST_LINES = 20_000
DEFAULT_PENDING_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_LINE_CHARS = 4096
# A line without its newline yet (a prompt, a progress bar) goes out once it is this old.
PARTIAL_AFTER_S = 0.5
_READ_BYTES = 65536
# Bigger pipes absorb a burst while the reader waits for the GIL (Linux only).
_PIPE_BYTES = 1024 * 1024
_F_SETPIPE_SZ = 1031
_ROW_OVERHEAD = 64  # bytes counted per buffered line beside its text

Row = tuple[float, str, int, str]  # ts, stream, seq, line


class _Stream:
    """One captured descriptor: its pipe, the saved original, the partial line."""

    __slots__ = ("fd", "name", "saved", "read_fd", "partial", "partial_since", "open")

    def __init__(self, fd: int, saved: int, read_fd: int) -> None:
        self.fd = fd
        self.name = STREAMS.get(fd, f"fd{fd}")
        self.saved = saved
        self.read_fd = read_fd
        self.partial = b""
        self.partial_since = 0.0
        self.open = True


class OutputCapture:
    """Tee fds 1 and 2 through pipes; lines wait in a bounded buffer for ``drain()``."""

    def __init__(
        self,
        *,
        fds: tuple[int, ...] = (1, 2),
        lines_per_s: float = DEFAULT_LINES_PER_S,
        burst_lines: int = DEFAULT_BURST_LINES,
        pending_bytes: int = DEFAULT_PENDING_BYTES,
        max_line_chars: int = DEFAULT_MAX_LINE_CHARS,
        clock: Callable[[], float] = time.time,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self._fds = fds
        self._rate = float(lines_per_s)
        self._burst = float(max(1, burst_lines))
        self._tokens = self._burst
        self._refilled = time.monotonic()
        self._cap = pending_bytes
        self._max_chars = max_line_chars
        self._clock = clock
        self._warn = warn
        self._streams: list[_Stream] = []
        self._rows: deque[tuple[Row, int]] = deque()
        self._bytes = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._drained = threading.Event()  # stopping, and what was written before stop() is read
        self._restore_lock = threading.Lock()
        self._seq = 0
        self._faulthandler = False  # it was enabled at start: pointed at the original stderr meanwhile
        self.lines_seen = 0
        self.lines_rate_dropped = 0  # over the line rate
        self.lines_full_dropped = 0  # oldest lines pushed out by the byte cap
        self.lines_cut = 0  # longer than max_line_chars
        self.console_errors = 0  # writes to the original descriptor that failed

    # ---------------------------------------------------------------- lifecycle

    @property
    def active(self) -> bool:
        return self._thread is not None and not self._stop.is_set()

    def start(self) -> None:
        """Install the pipes and the reader; raises OSError when it cannot (nothing left changed)."""
        if self._thread is not None:
            return
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        installed: list[_Stream] = []
        try:
            for fd in self._fds:
                read_fd, write_fd = os.pipe()
                with contextlib.suppress(OSError):
                    import fcntl

                    fcntl.fcntl(write_fd, _F_SETPIPE_SZ, _PIPE_BYTES)
                saved = os.dup(fd)
                os.set_inheritable(saved, False)
                os.dup2(write_fd, fd)
                os.close(write_fd)
                installed.append(_Stream(fd, saved, read_fd))
        except OSError:
            self._streams = installed
            self._restore()
            self._close_fds()
            raise
        self._streams = installed
        self._point_faulthandler()
        self._thread = threading.Thread(target=self._run, name="traceml-output", daemon=True)
        self._thread.start()

    def _point_faulthandler(self) -> None:
        """A fatal error kills the reader with the process: the fault handler writes past the pipe."""
        stderr = next((s for s in self._streams if s.fd == 2), None)
        if stderr is None or not faulthandler.is_enabled():
            return
        with contextlib.suppress(Exception):
            faulthandler.enable(file=stderr.saved, all_threads=True)
            self._faulthandler = True

    def stop(self, timeout: float = 1.0) -> None:
        """Restore the original descriptors, then read what the pipes still hold."""
        if self._thread is None:
            return
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        self._restore()
        self._stop.set()
        # The reader closes the pipes itself once every writer is gone (children may hold them).
        self._drained.wait(timeout)

    def _restore(self) -> None:
        with self._restore_lock:
            for s in self._streams:
                if s.saved >= 0:
                    with contextlib.suppress(OSError):
                        os.dup2(s.saved, s.fd)
            if self._faulthandler:
                with contextlib.suppress(Exception):
                    faulthandler.enable(file=2, all_threads=True)  # before the saved descriptor closes
                self._faulthandler = False

    def _close_fds(self) -> None:
        for s in self._streams:
            for fd in (s.read_fd, s.saved):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            s.read_fd = s.saved = -1

    # ---------------------------------------------------------------- reader thread

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # never leave the process writing into a pipe nobody reads
            self._restore()
            if self._warn is not None:
                with contextlib.suppress(Exception):
                    self._warn(f"output capture stopped ({exc!r}); output goes to the console only")
        finally:
            self._drained.set()
            self._close_fds()

    def _loop(self) -> None:
        by_fd = {s.read_fd: s for s in self._streams}
        poller = select.poll()
        for fd in by_fd:
            poller.register(fd, select.POLLIN)
        while by_fd:
            passing_through = self._drained.is_set()
            stopping = self._stop.is_set() and not passing_through
            ready = poller.poll(0 if stopping else 250)
            if not ready:
                if stopping:
                    # What the process wrote before stop() is read: from now on only children
                    # that inherited a pipe write here, and their bytes go to the console only.
                    self._flush_partials(True)
                    self._drained.set()
                elif not passing_through:
                    self._flush_partials(False)
                continue
            for fd, _events in ready:
                s = by_fd[fd]
                try:
                    data = os.read(fd, _READ_BYTES)
                except InterruptedError:
                    continue
                if not data:  # every writer is gone
                    poller.unregister(fd)
                    del by_fd[fd]
                    s.open = False
                    continue
                self._console(s, data)
                if not passing_through:
                    self._lines(s, data)
        if not self._drained.is_set():
            self._flush_partials(True)

    def _console(self, s: _Stream, data: bytes) -> None:
        """The bytes to the original descriptor, all of them, before anything else."""
        view = memoryview(data)
        while view:
            try:
                n = os.write(s.saved, view)
            except InterruptedError:
                continue
            except OSError:
                self.console_errors += 1
                return
            view = view[n:]

    def _lines(self, s: _Stream, data: bytes) -> None:
        parts = data.split(b"\n")
        if s.partial:
            parts[0] = s.partial + parts[0]
        rest = parts.pop()
        now = self._clock()
        if rest:
            if not s.partial:
                s.partial_since = time.monotonic()
            s.partial = rest
            if len(rest) > 4 * self._max_chars:  # an endless line: send what it has so far
                parts.append(rest)
                s.partial = b""
        else:
            s.partial = b""
        if parts:
            self._add(s.name, parts, now)

    def _flush_partials(self, final: bool) -> None:
        cutoff = time.monotonic() - PARTIAL_AFTER_S
        for s in self._streams:
            if s.partial and (final or s.partial_since <= cutoff):
                part, s.partial = s.partial, b""
                self._add(s.name, [part], self._clock())

    def _add(self, stream: str, parts: list[bytes], now: float) -> None:
        n = len(parts)
        seq0 = self._seq
        self._seq += n
        self.lines_seen += n
        mono = time.monotonic()
        self._tokens = min(self._burst, self._tokens + (mono - self._refilled) * self._rate)
        self._refilled = mono
        keep = min(n, int(self._tokens))
        self._tokens -= keep
        if keep < n:
            self.lines_rate_dropped += n - keep
        max_chars = self._max_chars
        rows: list[tuple[Row, int]] = []
        for i in range(keep):
            text = parts[i].decode("utf-8", "replace")
            if text.endswith("\r"):
                text = text[:-1]
            if len(text) > max_chars:
                text = text[:max_chars]
                self.lines_cut += 1
            rows.append(((now, stream, seq0 + i, text), len(text) + _ROW_OVERHEAD))
        if not rows:
            return
        with self._lock:
            self._rows.extend(rows)
            self._bytes += sum(size for _, size in rows)
            while self._bytes > self._cap and self._rows:
                _, size = self._rows.popleft()
                self._bytes -= size
                self.lines_full_dropped += 1

    # ---------------------------------------------------------------- sender thread

    def drain(self) -> dict[str, list[Any]] | None:
        """The buffered lines as the columns of the wire table "output" (None: none)."""
        with self._lock:
            if not self._rows:
                return None
            taken, self._rows = self._rows, deque()
            self._bytes = 0
        ts, stream, seq, line = zip(*(row for row, _ in taken), strict=True)
        return {"ts": list(ts), "stream": list(stream), "seq": list(seq), "line": list(line)}

    def counters(self) -> dict[str, int]:
        """Loss counters for the "drops" table (cumulative)."""
        return {
            "output_lines_rate_dropped": self.lines_rate_dropped,
            "output_lines_full_dropped": self.lines_full_dropped,
            "output_lines_cut": self.lines_cut,
        }
