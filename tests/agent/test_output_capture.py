"""Output capture: the console gets every byte in order, lines reach the buffer
without loss below the rate limit, and a consumer that never drains never blocks
the writer. Captures run on a descriptor of their own (a file dup'ed for the test)
or, for fds 1 and 2, in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from agent.config import load_config
from agent.output_capture import OutputCapture
from tests.support.procs import base_env


def _captured_fd(tmp_path: Path) -> tuple[int, Path]:
    """A descriptor writing to a file: what the capture tees to."""
    path = tmp_path / "console.txt"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    return fd, path


def _rows(capture: OutputCapture) -> list[tuple[Any, ...]]:
    cols = capture.drain()
    if cols is None:
        return []
    return list(zip(cols["ts"], cols["stream"], cols["seq"], cols["line"], strict=True))


def test_every_line_in_order_on_the_console_and_in_the_buffer(tmp_path: Path) -> None:
    fd, path = _captured_fd(tmp_path)
    capture = OutputCapture(fds=(fd,))
    capture.start()
    expected = [f"line {i} " + "x" * (i % 50) for i in range(10_000)]
    # Writes of every size: many lines at once, one line, a line in pieces.
    at = 0
    while at < len(expected):
        chunk = expected[at : at + 1 + at % 7]
        text = "".join(f"{line}\n" for line in chunk)
        if at % 3 == 0:
            os.write(fd, text[:5].encode())
            os.write(fd, text[5:].encode())
        else:
            os.write(fd, text.encode())
        at += len(chunk)
    capture.stop()
    os.close(fd)
    assert path.read_text() == "".join(f"{line}\n" for line in expected)
    rows = _rows(capture)
    assert [r[3] for r in rows] == expected
    assert [r[2] for r in rows] == list(range(len(expected)))
    assert {r[1] for r in rows} == {f"fd{fd}"}
    assert capture.counters() == {"output_lines_rate_dropped": 0, "output_lines_full_dropped": 0,
                                  "output_lines_cut": 0}


def test_the_rate_limit_drops_and_counts_but_the_console_gets_everything(tmp_path: Path) -> None:
    fd, path = _captured_fd(tmp_path)
    capture = OutputCapture(fds=(fd,), lines_per_s=1.0, burst_lines=100)
    capture.start()
    os.write(fd, b"".join(b"%d\n" % i for i in range(1000)))
    capture.stop()
    os.close(fd)
    assert path.read_text().splitlines() == [str(i) for i in range(1000)]
    rows = _rows(capture)
    kept = len(rows)
    assert 100 <= kept < 1000
    assert capture.lines_rate_dropped == 1000 - kept
    assert capture.lines_seen == 1000


def test_a_consumer_that_never_drains_never_blocks_the_writer(tmp_path: Path) -> None:
    fd, path = _captured_fd(tmp_path)
    capture = OutputCapture(fds=(fd,), pending_bytes=10_000, lines_per_s=1e9, burst_lines=10**9)
    capture.start()
    lines = 200_000  # several MB through a pipe of 1 MiB at most, nothing drained meanwhile
    writer = threading.Thread(target=lambda: [os.write(fd, b"%07d\n" % i) for i in range(lines)])
    writer.start()
    writer.join(120)  # a liveness bound: a blocked writer never returns
    assert not writer.is_alive()
    capture.stop()
    os.close(fd)
    assert path.read_text() == "".join(f"{i:07d}\n" for i in range(lines))
    rows = _rows(capture)
    # The byte cap kept the newest lines; everything older was dropped and counted.
    assert rows and rows[-1][3] == f"{lines - 1:07d}"
    assert capture.lines_full_dropped + capture.lines_rate_dropped + len(rows) == lines
    assert capture.lines_full_dropped > 0


def test_long_lines_are_cut_and_a_last_line_without_newline_is_kept(tmp_path: Path) -> None:
    fd, path = _captured_fd(tmp_path)
    capture = OutputCapture(fds=(fd,), max_line_chars=10)
    capture.start()
    os.write(fd, b"0123456789abcdef\r\nshort\nno newline")
    capture.stop()
    os.close(fd)
    assert path.read_bytes() == b"0123456789abcdef\r\nshort\nno newline"
    assert [r[3] for r in _rows(capture)] == ["0123456789", "short", "no newline"]
    assert capture.lines_cut == 1


_CHILD = r"""
import ctypes, json, os, sys
from agent.output_capture import OutputCapture
capture = OutputCapture()
capture.start()
print("python print")
sys.stderr.write("python stderr\n")
os.write(1, b"native write\n")
libc = ctypes.CDLL(None)
libc.puts(b"libc puts")
libc.fflush(None)
print("last")
capture.stop()
cols = capture.drain()
with open(sys.argv[1], "w") as fh:
    json.dump({"stream": cols["stream"], "line": cols["line"]}, fh)
print("after stop")
"""


def test_fd_level_capture_sees_python_and_native_writes(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, "-c", _CHILD, str(out)], env=base_env(), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    # The console still got everything, stdout in order, and the original fds came back.
    assert done.stdout.splitlines() == ["python print", "native write", "libc puts", "last", "after stop"]
    assert done.stderr == "python stderr\n"
    rows = json.loads(out.read_text())
    pairs = list(zip(rows["stream"], rows["line"], strict=True))
    assert [p for p in pairs if p[0] == "stdout"] == [("stdout", "python print"), ("stdout", "native write"),
                                                      ("stdout", "libc puts"), ("stdout", "last")]
    assert ("stderr", "python stderr") in pairs


def test_capture_is_on_by_default_and_off_with_the_variable() -> None:
    assert load_config({})[0].capture_output is True
    config, problems = load_config({"TRACEML_CAPTURE_OUTPUT": "0", "TRACEML_OUTPUT_LINES_PER_S": "500"})
    assert (config.capture_output, config.output_lines_per_s, problems) == (False, 500.0, [])


_CRASH = r"""
import faulthandler, os
from agent.output_capture import OutputCapture
faulthandler.enable()
OutputCapture().start()
faulthandler._sigsegv()
"""


def test_a_hard_crash_still_reaches_the_console() -> None:
    # The process dies with its reader; the fault handler writes past the pipe.
    done = subprocess.run([sys.executable, "-c", _CRASH], env=base_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "Fatal Python error: Segmentation fault" in done.stderr


_INHERITED_WRITER = """
import os, sys
fd = int(sys.argv[1])
sys.stdin.read()  # written only once the parent's capture has stopped
block = b"w" * 65535 + b"\\n"
for _ in range(48):  # 3 MiB: more than the pipe holds, with nobody capturing any more
    os.write(fd, block)
"""


def test_a_child_writing_after_stop_is_passed_through_and_never_blocks(tmp_path: Path) -> None:
    """A child that inherited the captured descriptor (a DataLoader worker, a subprocess)
    may write after stop(): its bytes reach the console, it neither blocks nor dies."""
    fd, path = _captured_fd(tmp_path)
    capture = OutputCapture(fds=(fd,))
    capture.start()
    os.write(fd, b"before stop\n")
    inherited = os.dup(fd)  # the pipe, as a forked worker holds it
    child = subprocess.Popen([sys.executable, "-c", _INHERITED_WRITER, str(inherited)], pass_fds=(inherited,),
                             stdin=subprocess.PIPE)
    os.close(inherited)
    capture.stop()
    assert child.stdin is not None
    child.stdin.close()  # go
    assert child.wait(120) == 0  # a liveness bound: a child blocked on a full pipe never exits
    thread = capture._thread
    assert thread is not None
    thread.join(60)  # the last writer closed the pipe: the reader ends and closes it
    assert not thread.is_alive()
    os.close(fd)
    text = path.read_bytes()
    assert text.startswith(b"before stop\n")
    assert text.count(b"w" * 65535 + b"\n") == 48
    assert [r[3] for r in _rows(capture)][0] == "before stop"
