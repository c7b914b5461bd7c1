"""The rank screen's profile key: ask the daemon serving the database for a torch.profiler
trace of the rank's next steps, as `traceml-daemon profile --wait 0` does (the request
file beside the database, traceml_daemon.commands.profile). Runs on a worker thread: the
daemon's answer takes up to a few hundred milliseconds. The trace, once written, is
listed on the rank screen like every other."""

from __future__ import annotations

from traceml_daemon.commands.profile import ProfileError, request
from traceml_daemon.store.reader import StoreError, UnknownSession

PROFILE_STEPS = 3  # steps a key press asks for


def ask(db_path: str, global_rank: int, session: str | None, steps: int = PROFILE_STEPS) -> tuple[str, str]:
    """(message, severity) for the notification after asking."""
    try:
        sent = request(db_path, global_rank, steps, session)
    except (ProfileError, StoreError, UnknownSession) as exc:
        return f"profile rank {global_rank}: {exc}", "warning"
    return (f"asked rank {global_rank} (session {sent.session}) to profile its next {steps} steps; "
            "the trace is listed on this screen once written"), "information"
