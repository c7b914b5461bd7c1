"""A screen of one block of text about a run, read in a worker of its own: on opening,
when the app saw a commit, and every ``reload_s``; a read that fails shows its error
and leaves the UI alive. Subclasses say what to read (``read``, on the worker thread)."""

from __future__ import annotations

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Static

from traceml_daemon.store.read.runs import RunRef
from traceml_daemon.tui.model import Snapshot
from traceml_daemon.tui.widgets import clean


class ReloadingScreen(Screen[None]):
    BINDINGS = [Binding("escape", "app.pop_screen", "Back")]
    BODY_ID = "body"  # the body's widget id (tests query it)
    ERROR_HEADER: str | None = None  # the header while a read fails (None: keep the last one)

    def __init__(self, db_path: str, run: RunRef, reload_s: float = 2.0) -> None:
        super().__init__()
        self.db_path = db_path
        self.run = run
        self.reload_s = reload_s
        self.loads = 0  # completed loads (tests wait on this)
        self._loading = False

    def heading(self) -> str:
        """The header until a read says otherwise."""
        raise NotImplementedError

    def read(self) -> tuple[str | None, Text]:
        """(a new header or None to keep it, the body), on the worker thread."""
        raise NotImplementedError

    def compose(self) -> ComposeResult:
        yield Static(Text(clean(self.heading()), style="bold"), id="header")
        with VerticalScroll():
            yield Static("loading…", id=self.BODY_ID)
        yield Footer()

    def on_mount(self) -> None:
        self._load()
        if self.reload_s > 0:
            self.set_interval(self.reload_s, self._tick)

    def show(self, snap: Snapshot) -> None:
        """The app's refresh: a commit it saw may have brought rows; read them."""
        self._tick()

    def _tick(self) -> None:
        if not self._loading:
            self._load()

    @work(thread=True, group="reload", exclusive=True, exit_on_error=False)
    def _load(self) -> None:
        self._loading = True
        try:
            head, body = self.read()
        except Exception as exc:  # a locked db: say so, keep the UI alive
            head, body = self.ERROR_HEADER, Text(clean(f"{exc.__class__.__name__}: {exc}"), style="red")
        self.app.call_from_thread(self._show, head, body)

    def _show(self, head: str | None, body: Text) -> None:
        self._loading = False
        if head is not None:
            self.query_one("#header", Static).update(Text(clean(head), style="bold"))
        self.query_one(f"#{self.BODY_ID}", Static).update(body)
        self.loads += 1
