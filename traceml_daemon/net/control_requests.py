"""Control requests from the command line, as files beside the database.

``traceml-daemon profile --db PATH`` reaches the daemon that serves ``PATH``
through a request directory next to it, ``PATH.control/``: the daemon creates
it (mode 0700, so only the database's owner can ask) and polls it; the CLI
writes ``<id>.request.json`` (written to a temporary name, then renamed) and
waits for ``<id>.result.json``. Whoever may write beside the database may read
everything in it already: the directory's permissions are the authentication,
as the token is on the wire. The request then goes down the connections that
already exist (``net.routes``: daemon -> relay -> agent).

Everything in the directory is hostile: names that are not ours are skipped,
files over ``MAX_REQUEST_BYTES`` or that do not validate are refused with a
result saying why, and counted (``ControlRequests.refused``, with a log line).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from traceml_daemon.net.routes import ControlRoutes, RouteError
from traceml_wire import messages
from traceml_wire.printable import printable

log = logging.getLogger("traceml_daemon.net.control")

POLL_S = 0.2
MAX_REQUEST_BYTES = 4096
MAX_PER_POLL = 16  # requests taken per poll; the rest wait for the next
STALE_RESULT_S = 600.0  # results nobody collected are removed after this
REQUEST_SUFFIX = ".request.json"
RESULT_SUFFIX = ".result.json"
_ID = re.compile(r"^[0-9a-f]{8,32}$")


def control_dir(db_path: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(db_path)}.control")


@dataclass(frozen=True)
class ProfileRequest:
    request_id: str
    rank: int
    steps: int
    session: str | None


def parse_request(request_id: str, data: bytes) -> ProfileRequest:
    """A request file's content, validated; ValueError says what is wrong."""
    if len(data) > MAX_REQUEST_BYTES:
        raise ValueError(f"request over {MAX_REQUEST_BYTES} bytes")
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ValueError("not a JSON object")
    if body.get("op") != messages.OP_PROFILE:
        raise ValueError(f"op must be {messages.OP_PROFILE!r}")
    rank, steps, session = body.get("rank"), body.get("steps"), body.get("session")
    if type(rank) is not int or not 0 <= rank < 2**31:
        raise ValueError("rank must be an int from 0")
    if type(steps) is not int or not 1 <= steps <= messages.MAX_PROFILE_STEPS:
        raise ValueError(f"steps must be an int from 1 to {messages.MAX_PROFILE_STEPS}")
    if session is not None and (type(session) is not str or not 0 < len(session) <= 256):
        raise ValueError("session must be a string of 1..256 characters")
    return ProfileRequest(request_id, rank, steps, session)


def write_json(path: Path, body: dict[str, Any]) -> None:
    """Written whole or not at all: a reader polling for it never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(body))
    os.replace(tmp, path)


class ControlRequests:
    """Polls the request directory of one database and routes what it finds."""

    def __init__(self, db_path: str, routes: ControlRoutes) -> None:
        self.directory = control_dir(db_path)
        self.routes = routes
        self.sent = 0  # requests written down a connection
        self.refused = 0  # malformed, misnamed, or for a rank no connection carries

    def prepare(self) -> None:
        self.directory.mkdir(mode=0o700, exist_ok=True)
        with contextlib.suppress(OSError):
            os.chmod(self.directory, 0o700)
        for old in self.directory.glob(f"*{REQUEST_SUFFIX}"):
            with contextlib.suppress(OSError):
                old.unlink()  # asked of an earlier daemon; its CLI has given up by now

    async def run(self) -> None:
        try:
            self.prepare()
        except OSError as exc:
            log.warning("control requests off: cannot create %s: %s", self.directory, exc)
            return
        try:
            while True:
                try:
                    self.poll()
                except OSError as exc:  # the directory went away or is unreadable: try again later
                    log.debug("control poll: %s", exc)
                await asyncio.sleep(POLL_S)
        finally:
            self.remove()

    def remove(self) -> None:
        """At shutdown: no directory means no daemon to ask (the CLI says so at once)."""
        with contextlib.suppress(OSError):
            for path in self.directory.iterdir():
                path.unlink()
            self.directory.rmdir()

    def poll(self) -> int:
        """Take the waiting requests (at most MAX_PER_POLL); how many were taken."""
        taken = 0
        now = time.time()
        with os.scandir(self.directory) as entries:
            names = [e.name for e in entries]
        for name in names:
            if name.endswith(RESULT_SUFFIX):
                self._expire(name, now)
            if not name.endswith(REQUEST_SUFFIX) or taken >= MAX_PER_POLL:
                continue
            request_id = name[: -len(REQUEST_SUFFIX)]
            path = self.directory / name
            if not _ID.match(request_id):
                self.refused += 1
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            taken += 1
            self._take(request_id, path)
        return taken

    def _take(self, request_id: str, path: Path) -> None:
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_REQUEST_BYTES + 1)
            path.unlink()
        except OSError:
            return  # taken away meanwhile
        try:
            request = parse_request(request_id, data)
            sent = self.routes.send(request.session, request.rank, request.steps, request_id)
        except (ValueError, RouteError) as exc:
            self.refused += 1
            log.warning("profile request %s refused: %s", request_id, printable(str(exc)))
            self._answer(request_id, {"status": "refused", "message": str(exc)})
            return
        self.sent += 1
        log.info("profile request %s: rank %d, %d steps, sent to %s", request_id, request.rank, request.steps,
                 printable(sent.sender))
        self._answer(request_id, {"status": "sent", "sender": sent.sender, "session": sent.session,
                                  "rank": request.rank, "steps": request.steps, "ts": time.time()})

    def _answer(self, request_id: str, body: dict[str, Any]) -> None:
        try:
            write_json(self.directory / f"{request_id}{RESULT_SUFFIX}", {"id": request_id, **body})
        except OSError as exc:
            log.warning("cannot answer profile request %s: %s", request_id, exc)

    def _expire(self, name: str, now: float) -> None:
        path = self.directory / name
        with contextlib.suppress(OSError):
            if now - path.stat().st_mtime > STALE_RESULT_S:
                path.unlink()
