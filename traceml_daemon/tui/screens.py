"""The TUI's screens: overview, node, rank, verdicts, help and the jump prompt.

Screens never touch the database: the app's refresh worker reads a
``Snapshot`` off the UI thread and hands it to the active screen's ``show``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import DataTable, Footer, Input, Static

from traceml_daemon.analysis.model import PHASES, Verdict
from traceml_daemon.tui.data import Delivery, NodeDetail, Overview, RankDetail, RankRow
from traceml_daemon.tui.widgets import (
    ABSENT,
    PHASE_COLORS,
    RankGrid,
    SparkList,
    fmt_bytes,
    fmt_duration,
    fmt_ms,
    fmt_num,
    fmt_pct,
    phase_bar,
    phase_legend,
)

METRICS = ("step",) + PHASES  # what the rank grid can show; `p` cycles
_SEV_STYLE = {"critical": "bold white on #c62828", "warn": "bold black on #f9a825", "info": "bold white on #1565c0"}
_PHASE_SHORT = {
    "dataloader": "data",
    "h2d": "h2d",
    "forward": "fwd",
    "backward": "bwd",
    "optimizer": "opt",
    "wait": "wait",
}


@dataclass(frozen=True)
class Snapshot:
    """Everything one refresh read; the detail fields only for the screen that asked."""

    overview: Overview
    node: NodeDetail | None = None
    rank: RankDetail | None = None


def fill_table(table: DataTable[Any], rows: Sequence[tuple[str, tuple[Any, ...]]]) -> None:
    """Show ``rows`` (key, cells) in ``table``, touching as little as possible.

    Adding rows makes DataTable measure every cell (about 0.4 s for 1024 ranks),
    so when the keys are unchanged, which is the normal case on a live run, only
    the cells whose text changed are updated in place. Otherwise the table is
    rebuilt and the cursor stays on the same key.
    """
    previous: list[tuple[str, tuple[Any, ...]]] | None = getattr(table, "_tui_rows", None)
    rows = list(rows)
    if previous is not None and [k for k, _ in previous] == [k for k, _ in rows]:
        columns = [c.key for c in table.ordered_columns]
        for (key, old), (_, new) in zip(previous, rows, strict=True):
            if old == new:
                continue
            for col, a, b in zip(columns, old, new, strict=True):
                if a != b:
                    # Re-measure the column only when the text got wider.
                    table.update_cell(key, col, b, update_width=len(str(b)) > len(str(a)))
        table._tui_rows = rows  # type: ignore[attr-defined]
        return
    current = None
    if table.row_count and 0 <= table.cursor_row < table.row_count:
        current = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
    table.clear()
    for key, cells in rows:
        table.add_row(*cells, key=key)
    table._tui_rows = rows  # type: ignore[attr-defined]
    if current is not None:
        keys = [k for k, _ in rows]
        if current in keys:
            table.move_cursor(row=keys.index(current), animate=False)


class PagedTable(DataTable[Any]):
    """A DataTable holding one page of a longer row list.

    DataTable measures every cell of a new row (about 1.3 s for 4096 ranks) and
    each in-place update is Python work, so only ``page`` rows live in the
    widget. Moving the cursor past the page's edge (arrows, PgUp/PgDn,
    Ctrl+Home/End) loads the page around the target row; keys stay the
    caller's, so selection and jumps work as before.
    """

    def __init__(self, *, page: int = 100, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.page_rows = max(2, page)
        self.first_row = 0  # index in ``all_rows`` of the table's first row
        self.all_rows: Sequence[Any] = []
        self._cells: Callable[[Any], tuple[str, tuple[Any, ...]]] = lambda row: row

    def set_rows(self, rows: Sequence[Any], cells: Callable[[Any], tuple[str, tuple[Any, ...]]] | None = None) -> None:
        """``rows``: items, turned into (key, cells) by ``cells`` for the shown page only
        (formatting 4096 rows of cells every refresh costs more than showing them)."""
        self.all_rows = rows
        if cells is not None:
            self._cells = cells
        self.first_row = max(0, min(self.first_row, len(self.all_rows) - self.page_rows))
        self._fill()

    def _fill(self) -> None:
        page = self.all_rows[self.first_row : self.first_row + self.page_rows]
        fill_table(self, [self._cells(row) for row in page])

    def _goto(self, index: int) -> bool:
        """Put the cursor on ``all_rows[index]``, loading its page; False when it is already loaded."""
        index = max(0, min(index, len(self.all_rows) - 1))
        if self.first_row <= index < self.first_row + self.row_count:
            return False
        self.first_row = max(0, min(index - self.page_rows // 2, len(self.all_rows) - self.page_rows))
        self._fill()
        self.move_cursor(row=index - self.first_row, animate=False)
        return True

    def _step(self, delta: int) -> bool:
        return self._goto(self.first_row + self.cursor_row + delta)

    def action_cursor_down(self) -> None:
        if not self._step(1):
            super().action_cursor_down()

    def action_cursor_up(self) -> None:
        if not self._step(-1):
            super().action_cursor_up()

    def action_page_down(self) -> None:
        if not self._step(max(1, self.scrollable_content_region.height - 1)):
            super().action_page_down()

    def action_page_up(self) -> None:
        if not self._step(-max(1, self.scrollable_content_region.height - 1)):
            super().action_page_up()

    def action_scroll_top(self) -> None:
        if not self._goto(0):
            super().action_scroll_top()

    def action_scroll_bottom(self) -> None:
        if not self._goto(len(self.all_rows) - 1):
            super().action_scroll_bottom()

    def window_label(self) -> str:
        """The " (rows a–b of n, ...)" suffix for the table's title when paged, else ""."""
        n = len(self.all_rows)
        if n <= self.page_rows:
            return ""
        return f" (rows {self.first_row + 1}–{self.first_row + self.row_count} of {n}, PgDn/PgUp)"


def rank_cells(r: RankRow, with_node: bool = True) -> tuple[Any, ...]:
    cells: list[Any] = [f"r{r.global_rank}"]
    if with_node:
        cells.append(f"n{r.node_rank}")
    cells += [str(r.steps), fmt_ms(r.step_ms)]
    cells += [fmt_ms(r.phase_ms.get(p)) for p in PHASES]
    return tuple(cells)


def rank_columns(with_node: bool = True) -> list[str]:
    return ["rank"] + (["node"] if with_node else []) + ["steps", "step ms"] + [_PHASE_SHORT[p] for p in PHASES]


def verdict_text(v: Verdict, evidence: bool = False) -> Text:
    text = Text()
    text.append(f" {v.severity.upper()} ", style=_SEV_STYLE.get(v.severity, "bold"))
    scope = ", ".join(
        f"{k.replace('global_rank', 'rank').replace('node_rank', 'node')} {val}" for k, val in v.scope.items()
    )
    text.append(f" {v.name}" + (f" [{scope}]" if scope else " [run]"), style="bold")
    text.append(f"\n{v.why}")
    if evidence:
        for key, val in v.evidence.items():
            text.append(f"\n  {key}: ", style="dim")
            text.append(str(val))
        if v.next_step:
            text.append("\n  next: ", style="dim")
            text.append(v.next_step)
    return text


class OverviewScreen(Screen[None]):
    BINDINGS = [Binding("p", "cycle_phase", "Phase")]

    def __init__(self) -> None:
        super().__init__()
        self.metric = 0
        self.last: Overview | None = None

    def compose(self) -> ComposeResult:
        yield Static("loading…", id="header")
        yield Static("", id="banner")
        with VerticalScroll(id="overview"):
            yield SparkList(label_width=11, id="spark")
            yield RankGrid(id="grid")
            yield Static("Nodes (worst first) — Enter: node", classes="section")
            nodes = PagedTable(id="nodes", cursor_type="row", zebra_stripes=True)
            # worst = the node's rank with the most busy time (step minus all-reduce wait), as in summary.
            nodes.add_columns("node", "host", "ranks", "median ms", "worst", "busy ms", "skew")
            yield nodes
            yield Static("Ranks — Enter: rank", classes="section", id="ranks_title")
            ranks = PagedTable(id="ranks", cursor_type="row", zebra_stripes=True)
            ranks.add_columns(*rank_columns())
            yield ranks
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#nodes", DataTable).focus()

    def action_cycle_phase(self) -> None:
        self.metric = (self.metric + 1) % len(METRICS)
        if self.last is not None:
            self._grid(self.last)

    def _grid(self, ov: Overview) -> None:
        metric = METRICS[self.metric]
        if metric == "step":
            values = [(r.global_rank, r.step_ms) for r in ov.ranks]
        else:
            values = [(r.global_rank, r.phase_ms.get(metric)) for r in ov.ranks]
        self.query_one(RankGrid).set_values(f"Rank grid: {metric} ms (p: next)", values)

    def show(self, snap: Snapshot) -> None:
        ov = snap.overview
        self.last = ov
        h = ov.header
        d = h.delivery
        state = "live" if h.live else "finished"
        head = Text()
        head.append(f"{h.session}", style="bold")
        # "2 nodes × 4 ranks" read as 8 ranks: say the world size, then where it runs.
        nodes = "1 node" if h.nnodes == 1 else f"{h.nnodes} nodes"
        head.append(f"  {h.world_size} ranks on {nodes}  {h.parallelism}  ")
        head.append(f"step {h.latest_step if h.latest_step is not None else ABSENT}", style="bold")
        if h.history and h.first_step:
            # Only when the run's start is not step 0 (a resumed run): the header must fit 80 columns.
            head.append(f" (from {h.first_step})")
        head.append(f"  {fmt_num(h.steps_per_s, ' steps/s', 1)}  up {fmt_duration(h.uptime_s)}\n")
        head.append(f"{state}  ", style="bold green" if h.live else "bold")
        if d.lost:
            # Rows and batches apart: a lost batch holds an unknown number of rows.
            head.append(f"LOST {d.rows_dropped} rows {d.batches_dropped} batches", style="bold red")
        else:
            head.append("delivery: no loss", style="green")
        head.append(
            f"  spooled {d.spooled}  frames {fmt_num(d.frames_received)}  rows {fmt_num(d.rows_stored)}"
            f"  dup {fmt_num(d.duplicates_discarded)}"
        )
        self.query_one("#header", Static).update(head)
        banner = self.query_one("#banner", Static)
        if not ov.verdicts_available:
            banner.update(Text("analysis: not available yet", style="dim"))
        elif not ov.verdicts:
            banner.update(Text(" OK  no findings", style="bold green"))
        else:
            more = f"  (+{len(ov.verdicts) - 1} more: v)" if len(ov.verdicts) > 1 else "  (v: details)"
            banner.update(verdict_text(ov.verdicts[0]).append(more, style="dim"))
        last = ov.step_series.last()
        self.query_one("#spark", SparkList).set_lines(
            [(ov.series_label, ov.step_series.values, f"{fmt_ms(last)} ms", "#4fc3f7")]
        )
        self._grid(ov)
        self.query_one("#nodes", PagedTable).set_rows(
            [
                (
                    str(n.node_rank),
                    (
                        f"n{n.node_rank}",
                        n.hostname or ABSENT,
                        str(n.ranks),
                        fmt_ms(n.median_ms),
                        ABSENT if n.worst_rank is None else f"r{n.worst_rank}",
                        fmt_ms(n.worst_busy_ms),
                        fmt_num(n.skew_pct, "%", 1),
                    ),
                )
                for n in ov.nodes
            ],
        )
        ranks = self.query_one("#ranks", PagedTable)
        ranks.set_rows(ov.ranks, lambda r: (str(r.global_rank), rank_cells(r)))
        self.query_one("#ranks_title", Static).update("Ranks — Enter: rank" + ranks.window_label())

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        key = event.row_key.value
        if key is None:
            return
        if event.data_table.id == "nodes":
            self.app.open_node(int(key))  # type: ignore[attr-defined]
        elif event.data_table.id == "ranks":
            self.app.open_rank(int(key))  # type: ignore[attr-defined]


class NodeScreen(Screen[None]):
    BINDINGS = [Binding("escape", "app.pop_screen", "Back")]

    def __init__(self, node_rank: int) -> None:
        super().__init__()
        self.node_rank = node_rank

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(f"Node {self.node_rank}", id="title")
            yield Static("Step time per rank (ms)", classes="section", id="sparks_title")
            yield SparkList(label_width=7, id="sparks")
            yield Static("Phase breakdown (median of recent steps)", classes="section")
            yield Static("", id="phases")
            yield Static("System", classes="section")
            yield Static("", id="system")
            yield SparkList(label_width=7, id="cpu")
            gpus: DataTable[Any] = DataTable(id="gpus", cursor_type="row", show_cursor=False)
            gpus.add_columns("gpu", "util", "mem used", "mem total", "temp", "power")
            yield gpus
            yield Static("Ranks — Enter: rank", classes="section")
            ranks: DataTable[Any] = DataTable(id="ranks", cursor_type="row")
            ranks.add_columns(*rank_columns(with_node=False))
            yield ranks
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#ranks", DataTable).focus()

    def show(self, snap: Snapshot) -> None:
        nd = snap.node
        if nd is None:
            self.query_one("#title", Static).update(f"Node {self.node_rank}: no ranks")
            return
        self.query_one("#title", Static).update(
            Text(f"Node {nd.node_rank}  {nd.hostname or ABSENT}  {len(nd.ranks)} ranks", style="bold")
        )
        self.query_one("#sparks", SparkList).set_lines(
            [(f"r{g}", s.values, f"{fmt_ms(s.last())}", "#4fc3f7") for g, s in nd.step_series.items()]
        )
        title = "Step time per rank (ms)"
        if len(nd.step_series) < len(nd.ranks):  # the reader draws the first NODE_SPARK_RANKS only
            title += f" — showing {len(nd.step_series)} of {len(nd.ranks)} ranks"
        self.query_one("#sparks_title", Static).update(title)
        phases = Text()
        phases.append_text(phase_legend())
        for r in nd.ranks:
            phases.append(f"\nr{r.global_rank}".ljust(7))
            phases.append_text(phase_bar(r.phase_ms, 40))
            phases.append(f" {fmt_ms(r.step_ms)} ms")
        self.query_one("#phases", Static).update(phases)
        sysw = self.query_one("#system", Static)
        if nd.system is None:
            sysw.update(Text("no host samples from this node (sampler absent)", style="dim"))
            self.query_one("#cpu", SparkList).set_lines([])
        else:
            s = nd.system
            sysw.update(
                f"CPU {fmt_pct(s.cpu_pct)}  RAM {fmt_bytes(s.mem_used_bytes)} / {fmt_bytes(s.mem_total_bytes)}"
                f"  net rx {fmt_bytes(s.net_rx_bps)}/s tx {fmt_bytes(s.net_tx_bps)}/s"
            )
            self.query_one("#cpu", SparkList).set_lines([("cpu %", s.cpu_series.values, fmt_pct(s.cpu_pct), "#ffb74d")])
        fill_table(
            self.query_one("#gpus", DataTable),
            [
                (
                    str(g.gpu_index),
                    (
                        str(g.gpu_index),
                        fmt_pct(g.util_pct),
                        fmt_bytes(g.mem_used_bytes),
                        fmt_bytes(g.mem_total_bytes),
                        fmt_num(g.temp_c, " C"),
                        fmt_num(g.power_w, " W"),
                    ),
                )
                for g in nd.gpus
            ]
            or [("none", ("no GPU samples", "", "", "", "", ""))],
        )
        fill_table(
            self.query_one("#ranks", DataTable),
            [(str(r.global_rank), rank_cells(r, with_node=False)) for r in nd.ranks],
        )

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if event.data_table.id == "ranks" and event.row_key.value is not None:
            self.app.open_rank(int(event.row_key.value))  # type: ignore[attr-defined]


class RankScreen(Screen[None]):
    BINDINGS = [Binding("escape", "app.pop_screen", "Back")]

    def __init__(self, global_rank: int) -> None:
        super().__init__()
        self.global_rank = global_rank

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(f"Rank {self.global_rank}", id="title")
            yield Static("Phases over the run (ms)", classes="section")
            yield SparkList(label_width=11, id="phases")
            yield Static("Memory over the run", classes="section")
            yield SparkList(label_width=11, id="memory")
            yield Static("Process", classes="section")
            yield Static("", id="process")
            yield Static("Scalars", classes="section")
            yield SparkList(label_width=11, id="scalars")
            yield Static("Models", classes="section")
            yield Static("", id="models")
            yield Static("Layers (deep dive)", classes="section", id="layers_title")
            layers: DataTable[Any] = DataTable(id="layers", cursor_type="row")
            layers.add_columns("layer", "fwd ms", "bwd ms", "activations")
            yield layers
        yield Footer()

    def show(self, snap: Snapshot) -> None:
        rd = snap.rank
        if rd is None:
            self.query_one("#title", Static).update(f"Rank {self.global_rank}: not in this run")
            return
        r = rd.row
        self.query_one("#title", Static).update(
            Text(
                f"Rank {r.global_rank}  node {r.node_rank} local {r.local_rank if r.local_rank is not None else ABSENT}"
                f"  {r.hostname or ABSENT}  steps {r.steps}  step {fmt_ms(r.step_ms)} ms  now: {r.status_phase or ABSENT}",
                style="bold",
            )
        )
        self.query_one("#phases", SparkList).set_lines(
            [(p, s.values, f"{fmt_ms(s.last())}", PHASE_COLORS[p]) for p, s in rd.phase_series.items()]
        )
        self.query_one("#memory", SparkList).set_lines(
            [(name, s.values, fmt_bytes(s.last()), "#ba68c8") for name, s in rd.memory_series.items()]
        )
        p = rd.process
        self.query_one("#process", Static).update(
            Text("no process samples", style="dim")
            if p is None
            else f"CPU {fmt_pct(p.cpu_pct)}  RSS {fmt_bytes(p.rss_bytes)}  GPU mem {fmt_bytes(p.gpu_mem_bytes)}"
            f"  threads {fmt_num(p.threads)}"
        )
        self.query_one("#scalars", SparkList).set_lines(
            [(name, s.values, fmt_num(latest, digits=4), "#81c784") for name, (latest, s) in rd.scalars.items()]
        )
        models = Text()
        for m in rd.models:
            models.append(f"{m.name or ABSENT} ({m.parallelism or ABSENT}) modules {fmt_num(m.n_modules)}")
            models.append(f"  params {fmt_bytes(m.param_bytes)}")
            if m.local_shard_bytes is not None or m.parallelism == "fsdp2":
                models.append(
                    f"\n  FSDP2 shard {fmt_bytes(m.local_shard_bytes)} of ~{fmt_bytes(m.estimated_full_bytes)} full",
                    style="bold",
                )
            models.append("\n")
        self.query_one("#models", Static).update(models if rd.models else Text("no model reported", style="dim"))
        title = self.query_one("#layers_title", Static)
        table = self.query_one("#layers", DataTable)
        if rd.layers:
            title.update(f"Layers (deep dive, step {rd.layers_step})")
        else:
            title.update(Text("Layers: no deep dive data", style="dim"))
        table.display = bool(rd.layers)
        fill_table(
            table,
            [
                (str(i), (lr.layer, fmt_ms(lr.forward_ms), fmt_ms(lr.backward_ms), fmt_bytes(lr.activation_bytes)))
                for i, lr in enumerate(rd.layers)
            ],
        )


class VerdictsScreen(Screen[None]):
    BINDINGS = [Binding("escape", "app.pop_screen", "Back")]

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static("Findings", classes="section")
            yield Static("", id="verdicts")
            yield Static("Delivery", classes="section")
            yield Static("", id="delivery")
        yield Footer()

    def show(self, snap: Snapshot) -> None:
        ov = snap.overview
        text = Text()
        if not ov.verdicts_available:
            text.append("analysis engine not available", style="dim")
        elif not ov.verdicts:
            text.append("no findings", style="green")
        for i, v in enumerate(ov.verdicts):
            if i:
                text.append("\n\n")
            text.append_text(verdict_text(v, evidence=True))
        self.query_one("#verdicts", Static).update(text)
        self.query_one("#delivery", Static).update(delivery_text(ov.header.delivery))


def delivery_text(d: Delivery) -> Text:
    """The delivery panel: what was lost (rows and batches apart), then every counter.

    Agent and relay counters arrive summed over senders (``delivery_counters``),
    so the panel is a few lines at 4096 ranks, not one per sender.
    """
    dt = Text()
    dt.append(
        f"rows dropped {d.rows_dropped}  batches dropped {d.batches_dropped}  spooled {d.spooled}\n",
        style="bold red" if d.lost else "bold",
    )
    groups: dict[str, list[str]] = {"daemon": [], "agents": [], "relays": []}
    for name, value in sorted(d.counters.items()):
        if name.startswith("agent_"):
            groups["agents"].append(f"{name.removeprefix('agent_')} {value}")
        elif name.startswith("relay_"):
            groups["relays"].append(f"{name.removeprefix('relay_')} {value}")
        elif not name.endswith("_reported"):  # the two totals are the line above
            groups["daemon"].append(f"{name} {value}")
    for label, items in groups.items():
        if items:
            dt.append(f"{label}: ", style="dim")
            dt.append("  ".join(items) + "\n")
    return dt


HELP = """\
TraceML — keys

  arrows / Tab   move, switch table
  Enter          drill into the selected node or rank
  Escape         back
  p              cycle the rank grid's metric (step, phases)
  v              findings and delivery
  /              jump: r12 or 12 (rank), n3 (node)
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
