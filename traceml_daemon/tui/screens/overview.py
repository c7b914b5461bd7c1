"""The overview: run header, findings banner, step sparkline, rank grid, node and rank tables."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

from traceml_daemon.analysis.model import PHASES
from traceml_daemon.tui.model import Overview, Snapshot
from traceml_daemon.tui.screens.findings import verdict_text
from traceml_daemon.tui.screens.tables import PagedTable, rank_cells, rank_columns
from traceml_daemon.tui.widgets import ABSENT, RankGrid, SparkList, clean, fmt_duration, fmt_ms, fmt_num

METRICS = ("step",) + PHASES  # what the rank grid can show; `p` cycles


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
        head.append(clean(h.session), style="bold")
        # "2 nodes × 4 ranks" read as 8 ranks: say the world size, then where it runs.
        nodes = "1 node" if h.nnodes == 1 else f"{h.nnodes} nodes"
        head.append(f"  {h.world_size} ranks on {nodes}  {clean(h.parallelism)}  ")
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
        if ov.new_runs:
            # The view stays on its run: say that others started instead of switching to them.
            shown = ov.new_runs[-3:]
            more = f" (+{len(ov.new_runs) - len(shown)} more)" if len(ov.new_runs) > len(shown) else ""
            head.append("\nnew run: " if len(ov.new_runs) == 1 else "\nnew runs: ", style="bold yellow")
            head.append(clean(", ".join(shown)) + more + "  (r: pick a run)")
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

