"""The run picker (``r``): every run of the database; Enter shows the selected one.

Its first row follows the latest run again (as the TUI does at start). The app
reads the runs off the UI thread and hands them over; this screen reads nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Static

from traceml_daemon.store.read.runs import RunInfo, RunRef
from traceml_daemon.tui.screens.tables import fill_table
from traceml_daemon.tui.widgets import ABSENT, clean

FOLLOW = "follow"  # the first row's key; the others are indexes into the run list


@dataclass(frozen=True)
class Pick:
    """What the picker chose: a session to pin, or None to follow the latest run."""

    session: str | None


class RunsScreen(ModalScreen[Pick | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("r", "cancel", "Close")]
    DEFAULT_CSS = """
    RunsScreen { align: center middle; }
    RunsScreen > Vertical { width: 90%; height: auto; max-height: 90%; border: round $accent; background: $surface; }
    RunsScreen DataTable { height: auto; max-height: 20; }
    """

    def __init__(self, runs: list[RunInfo], latest: RunRef | None, shown: RunRef | None, pinned: bool,
                 now: float) -> None:
        super().__init__()
        self.runs = runs
        self.latest = latest
        self.shown = shown
        self.pinned = pinned
        self.now = now

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static("Runs (oldest first) — Enter: show, Escape: back", classes="section")
            table: DataTable[object] = DataTable(id="runs", cursor_type="row", zebra_stripes=True)
            table.add_columns("", "session", "attempt", "ranks", "nodes", "step", "state")
            yield table

    def on_mount(self) -> None:
        table = self.query_one("#runs", DataTable)
        latest = self.latest.session if self.latest is not None else None
        rows: list[tuple[str, tuple[str, ...]]] = [
            (FOLLOW, ("" if self.pinned else ">", "follow the latest run", "", "", "", "", ""))
        ]
        for i, run in enumerate(self.runs):
            shown = self.shown is not None and run.session == self.shown.session
            mark = ">" if shown and self.pinned else ""
            # Sessions are peer text: cleaned, and the table holds them as plain text.
            name = clean(run.session) + (" (latest)" if run.session == latest else "")
            rows.append((str(i), (
                mark, name, str(run.run.attempt), str(run.ranks), str(run.nodes),
                ABSENT if run.last_step is None else str(run.last_step), run.state(self.now),
            )))
        fill_table(table, rows)
        current = next((i for i, r in enumerate(self.runs) if self.pinned and self.shown
                        and r.session == self.shown.session), None)
        table.move_cursor(row=0 if current is None else current + 1, animate=False)
        table.focus()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        key = event.row_key.value
        if key == FOLLOW:
            self.dismiss(Pick(None))
        elif key is not None:
            self.dismiss(Pick(self.runs[int(key)].session))

    def action_cancel(self) -> None:
        self.dismiss(None)
