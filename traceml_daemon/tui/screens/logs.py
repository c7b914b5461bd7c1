"""The Logs screen: the ranks' captured output, identical lines folded across ranks
(``[ranks 0-63 x12] ...``), tracebacks and errors first, as ``traceml-daemon logs``
prints it. It reads in a worker of its own, on opening and then when the database
changed (every ``reload_s``)."""

from __future__ import annotations

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Static

from traceml_daemon.analysis.output_fold import Folded, render
from traceml_daemon.store.read.runs import RunRef
from traceml_daemon.tui.evidence import read_logs
from traceml_daemon.tui.model import Snapshot
from traceml_daemon.tui.widgets import clean

_KIND_STYLE = {"traceback": "bold red", "error": "red", "warning": "yellow", "line": ""}


class LogsScreen(Screen[None]):
    BINDINGS = [Binding("escape", "app.pop_screen", "Back")]

    def __init__(self, db_path: str, run: RunRef, reload_s: float = 2.0) -> None:
        super().__init__()
        self.db_path = db_path
        self.run = run
        self.reload_s = reload_s
        self.loads = 0  # completed loads (tests wait on this)
        self._loading = False

    def compose(self) -> ComposeResult:
        yield Static(Text(clean(f"Output of session {self.run.session}"), style="bold"), id="header")
        with VerticalScroll():
            yield Static("loading…", id="logs")
        yield Footer()

    def on_mount(self) -> None:
        self._load()
        if self.reload_s > 0:
            self.set_interval(self.reload_s, self._tick)

    def show(self, snap: Snapshot) -> None:
        """The app's refresh: a commit it saw may have brought lines; read them."""
        self._tick()

    def _tick(self) -> None:
        if not self._loading:
            self._load()

    @work(thread=True, group="logs", exclusive=True, exit_on_error=False)
    def _load(self) -> None:
        self._loading = True
        try:
            count, entries = read_logs(self.db_path, self.run)
            body = _text(entries)
            head = (f"Output of session {self.run.session}: {count:,} lines, {len(entries)} distinct"
                    " — tracebacks and errors first (Esc back)")
        except Exception as exc:  # a locked db: say so, keep the UI alive
            body, head = Text(clean(f"{exc.__class__.__name__}: {exc}"), style="red"), "Output"
        self.app.call_from_thread(self._show, head, body)

    def _show(self, head: str, body: Text) -> None:
        self._loading = False
        self.query_one("#header", Static).update(Text(clean(head), style="bold"))
        self.query_one("#logs", Static).update(body)
        self.loads += 1


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
