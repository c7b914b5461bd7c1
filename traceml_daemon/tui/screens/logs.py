"""The Logs screen: the ranks' captured output, identical lines folded across ranks
(``[ranks 0-63 x12] ...``), tracebacks and errors first, as ``traceml-daemon logs``
prints it. It reads in a worker of its own, on opening and then when the database
changed (every ``reload_s``), as every ``ReloadingScreen``."""

from __future__ import annotations

from rich.text import Text

from traceml_daemon.analysis.output_fold import Folded, render
from traceml_daemon.tui.evidence import read_logs
from traceml_daemon.tui.screens.reloading import ReloadingScreen
from traceml_daemon.tui.widgets import clean

_KIND_STYLE = {"traceback": "bold red", "error": "red", "warning": "yellow", "line": ""}


class LogsScreen(ReloadingScreen):
    BODY_ID = "logs"
    ERROR_HEADER = "Output"

    def heading(self) -> str:
        return f"Output of session {self.run.session}"

    def read(self) -> tuple[str | None, Text]:
        count, entries = read_logs(self.db_path, self.run)
        return (f"Output of session {self.run.session}: {count:,} lines, {len(entries)} distinct"
                " — tracebacks and errors first (Esc back)"), _text(entries)


def _text(entries: list[Folded]) -> Text:
    if not entries:
        return Text("no output captured (TRACEML_CAPTURE_OUTPUT=0, or nothing printed yet)", style="dim")
    out = Text()
    for i, entry in enumerate(entries):
        if i:
            out.append("\n")
        # Rank output is peer text: written out, never interpreted as markup.
        out.append("\n".join(clean(line) for line in render([entry])), style=_KIND_STYLE[entry.kind])
    return out
