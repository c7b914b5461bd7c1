"""Drill-down screens: one node (its ranks, host and GPUs) and one rank (phases, memory,
process, scalars, models, layers)."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

from traceml_daemon.tui.model import Snapshot
from traceml_daemon.tui.screens.tables import fill_table, rank_cells, rank_columns
from traceml_daemon.tui.widgets import (
    ABSENT,
    PHASE_COLORS,
    SparkList,
    clean,
    fmt_bytes,
    fmt_ms,
    fmt_num,
    fmt_pct,
    phase_bar,
    phase_legend,
)


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
            Text(f"Node {nd.node_rank}  {clean(nd.hostname or ABSENT)}  {len(nd.ranks)} ranks", style="bold")
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


def shard_view(v: dict[str, Any]) -> Text:
    """The rank's FSDP2 block: mesh, shard and full size, memory per step, wait in collectives."""
    shard, replicate = v.get("shard_degree"), v.get("replicate_degree")
    mesh = ABSENT if shard is None else (f"{replicate} replicas x {shard} shards" if replicate else f"{shard} shards")
    out = Text("FSDP2 shard view", style="bold")
    out.append(f"  mesh {mesh}\n")
    out.append(f"  shard {fmt_bytes(v.get('local_shard_bytes'))} of ~{fmt_bytes(v.get('estimated_full_bytes'))} full"
               f"   peak/step {fmt_bytes(v.get('peak_bytes'))}   after forward {fmt_bytes(v.get('post_forward_bytes'))}\n")
    ms = {k: None if v.get(k) is None else v[k] / 1e6 for k in ("fwd_comm_ns", "bwd_comm_ns", "replicate_comm_ns")}
    out.append(f"  waiting in collectives per step (ms): forward {fmt_ms(ms['fwd_comm_ns'])}"
               f"  backward {fmt_ms(ms['bwd_comm_ns'])}")
    if replicate:
        out.append(f"  (replicate all-reduce {fmt_ms(ms['replicate_comm_ns'])})")
    return out


class RankScreen(Screen[None]):
    BINDINGS = [
        Binding("escape", "app.pop_screen", "Back"),
        # Not in the footer (snapshots unchanged); listed in the help.
        Binding("P", "profile", "Profile", show=False),
    ]

    def __init__(self, global_rank: int) -> None:
        super().__init__()
        self.global_rank = global_rank

    def action_profile(self) -> None:
        """Ask the live rank for a torch.profiler trace of its next steps (tui/profiling.py)."""
        app: Any = self.app
        run = app.data.run
        session = run.session if run is not None else None
        self._ask_profile(app.db_path, self.global_rank, session)

    @work(thread=True, group="profile", exclusive=True, exit_on_error=False)
    def _ask_profile(self, db_path: str, global_rank: int, session: str | None) -> None:
        from traceml_daemon.tui.profiling import ask

        message, severity = ask(db_path, global_rank, session)
        self.app.call_from_thread(self.app.notify, message, severity=severity, markup=False, timeout=8)

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
            yield Static("", id="shard")  # FSDP2 only (hidden otherwise)
            yield Static("", id="profiles")  # torch.profiler traces of listed steps (hidden when none)
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
                f"  {clean(r.hostname or ABSENT)}  steps {r.steps}  step {fmt_ms(r.step_ms)} ms"
                f"  now: {clean(r.status_phase or ABSENT)}",
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
            models.append(f"{clean(m.name or ABSENT)} ({clean(m.parallelism or ABSENT)}) modules {fmt_num(m.n_modules)}")
            models.append(f"  params {fmt_bytes(m.param_bytes)}")
            if m.local_shard_bytes is not None or m.parallelism == "fsdp2":
                models.append(
                    f"\n  FSDP2 shard {fmt_bytes(m.local_shard_bytes)} of ~{fmt_bytes(m.estimated_full_bytes)} full",
                    style="bold",
                )
            models.append("\n")
        self.query_one("#models", Static).update(models if rd.models else Text("no model reported", style="dim"))
        shard = self.query_one("#shard", Static)
        shard.display = rd.fsdp2 is not None
        if rd.fsdp2 is not None:
            shard.update(shard_view(rd.fsdp2))
        profiles = self.query_one("#profiles", Static)
        profiles.display = bool(rd.profiles)
        if rd.profiles:
            text = Text("torch.profiler traces", style="bold")
            for step, steps, path in rd.profiles:
                text.append(clean(f"\n  step {step} ({steps} steps): {path}"))
            profiles.update(text)
        title = self.query_one("#layers_title", Static)
        table = self.query_one("#layers", DataTable)
        if rd.layers:
            title.update(f"Layers (deep dive, step {rd.layers_step})")
        elif rd.fsdp2 is not None:
            title.update(Text("Layers: no per-layer deep dive under FSDP2 (layer hooks would see only shards)",
                              style="dim"))
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
