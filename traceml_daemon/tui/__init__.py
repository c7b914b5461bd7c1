"""The Textual terminal UI (``traceml-daemon tui``); ``data`` is its textual-free reader."""

from __future__ import annotations

__all__ = ["run_tui", "main"]


def run_tui(db_path: str) -> None:
    # Imported lazily so `import traceml_daemon.tui` stays cheap for the CLI.
    from traceml_daemon.tui.app import run_tui as _run

    _run(db_path)


def main(args: object = None) -> int:
    from traceml_daemon.tui.app import main as _main

    return _main(args)  # type: ignore[arg-type]
