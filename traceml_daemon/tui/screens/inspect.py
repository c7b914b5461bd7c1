"""The step inspector: everything every rank recorded at one step (``traceml-daemon
inspect``'s view), opened from the overview, a node or a rank (``i``), or at a
verdict's step from the findings. Left/right: previous/next step; ``g``: go to a step."""

from __future__ import annotations

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Footer, Input, Static

from traceml_daemon.commands.inspect import render_text
from traceml_daemon.store.read.runs import RunRef
from traceml_daemon.store.read.step_detail import RankNotFound, StepNotFound
from traceml_daemon.tui.evidence import StepPick, default_step, read_step, verdict_step
from traceml_daemon.tui.model import Snapshot
from traceml_daemon.tui.widgets import clean


class StepScreen(Screen[None]):
    BINDINGS = [
        Binding("escape", "app.pop_screen", "Back"),
        Binding("left", "step(-1)", "Prev step"),
        Binding("right", "step(1)", "Next step"),
        Binding("g", "goto", "Go to step"),
    ]

    def __init__(self, db_path: str, run: RunRef, *, rank: int | None = None, step: int | None = None,
                 verdict_rank: int | None = None) -> None:
        """``step`` None: the newest step every rank recorded (``rank``'s, when given), or with
        ``verdict_rank`` the step where that rank's verdict shows most."""
        super().__init__()
        self.db_path = db_path
        self.run = run
        self.rank = rank
        self.step = step
        self.verdict_rank = verdict_rank
        self.why = "step asked for" if step is not None else ""
        self.loads = 0  # completed loads (tests wait on this)

    def compose(self) -> ComposeResult:
        yield Static("Step inspector", id="header")
        with VerticalScroll():
            yield Static("loading…", id="step_view")
        yield Footer()

    def on_mount(self) -> None:
        self._load(self.step)

    def show(self, snap: Snapshot) -> None:
        """The app's refresh: this screen reads its own step (a step does not change once stored)."""

    def action_step(self, delta: int) -> None:
        if self.step is not None:
            self.why = "stepped"
            self._load(self.step + delta)

    def action_goto(self) -> None:
        self.app.push_screen(StepPrompt(), self._goto)

    def _goto(self, text: str | None) -> None:
        if text is None:
            return
        try:
            step = int(text.strip())
        except ValueError:
            self.notify(f"{text.strip()!r} is not a step number", severity="warning", markup=False)
            return
        self.why = "step asked for"
        self._load(step)

    @work(thread=True, group="step", exclusive=True, exit_on_error=False)
    def _load(self, step: int | None) -> None:
        why = self.why
        try:
            if step is None:
                pick: StepPick = (verdict_step(self.db_path, self.run, self.verdict_rank)
                                  if self.verdict_rank is not None else default_step(self.db_path, self.run, self.rank))
                step, why = pick.step, pick.why
            if step is None:
                body: Text | str = Text(why, style="dim")
            else:
                body = render_text(read_step(self.db_path, self.run, step, self.rank), self.rank)
        except (StepNotFound, RankNotFound) as exc:
            body = Text(clean(str(exc.args[0])), style="yellow")
        except Exception as exc:  # a locked db: say so, keep the UI alive
            body = Text(clean(f"{exc.__class__.__name__}: {exc}"), style="red")
        self.app.call_from_thread(self._show, step, why, body)

    def _show(self, step: int | None, why: str, body: Text | str) -> None:
        if step is not None and not (isinstance(body, Text) and body.style == "yellow"):
            self.step = step
        self.why = why
        who = "every rank" if self.rank is None else f"rank {self.rank}"
        self.query_one("#header", Static).update(
            Text(clean(f"Step {self.step if self.step is not None else '-'} of session {self.run.session}: {who}"
                       f" — {why}  (←/→ step, g go to, Esc back)"), style="bold")
        )
        # Plain text: span, layer and host names and output lines are peer text.
        self.query_one("#step_view", Static).update(body if isinstance(body, Text) else Text(body))
        self.loads += 1


class StepPrompt(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel")]
    DEFAULT_CSS = """
    StepPrompt { align: center middle; }
    StepPrompt > Vertical { width: 40; height: auto; border: round $accent; background: $surface; }
    """

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static("Go to step:")
            yield Input(placeholder="120", id="step")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value)

    def action_cancel(self) -> None:
        self.dismiss(None)
