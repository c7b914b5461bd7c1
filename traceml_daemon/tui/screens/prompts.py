"""Modal prompts: the key help and the jump-to-rank-or-node input."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Static

HELP = """\
TraceML — keys

  arrows / Tab   move, switch table
  Enter          drill into the selected node or rank
  Escape         back
  p              cycle the rank grid's metric (step, phases)
  v              findings and delivery
  /              jump: r12 or 12 (rank), n3 (node)
  r              runs: pick the run shown (runs started later are announced)
  i              step inspector: every rank at one step (from findings: the
                 first rank verdict's step); arrows step, g go to a step
  l              logs: the ranks' output folded across ranks, errors first
  o              rollouts: RL sessions, phase percentiles, pending, reasons
  P              on a rank: profile its next 3 steps with torch.profiler
                 (a live run; the trace is listed on the rank screen)
  ?              this help
  q              quit

Values are medians over each rank's recent steps; — means not measured.
A node's worst rank is the one with the most busy time (step minus wait):
under DDP every rank reports the same step time."""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape", "app.pop_screen", "Close"), Binding("question_mark", "app.pop_screen", "Close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > Vertical { width: 64; height: auto; border: round $accent; background: $surface; padding: 0 1; }
    """

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(HELP)


class JumpScreen(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel")]
    DEFAULT_CSS = """
    JumpScreen { align: center middle; }
    JumpScreen > Vertical { width: 44; height: auto; border: round $accent; background: $surface; }
    """

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static("Jump to rank (r12, 12) or node (n3):")
            yield Input(placeholder="r0", id="jump")
            yield Static("", id="error")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value)

    def action_cancel(self) -> None:
        self.dismiss(None)
