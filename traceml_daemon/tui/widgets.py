"""Small renderables for the TUI: number formats, sparklines, the rank grid.

Sparklines are drawn as text (not textual's Sparkline) because telemetry has
holes: a ``None`` sample must stay visible as a gap, never become zero.

Text that came from a peer (hostnames, sessions, layer and scalar names) is
shown through ``plain``/``clean``: never parsed as markup, control characters
written out, so a name like ``[/]`` or an escape sequence prints as it is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rich.text import Text
from textual.geometry import Size
from textual.widget import Widget

ABSENT = "—"
_BLOCKS = "▁▂▃▄▅▆▇█"
PHASE_COLORS = {
    "dataloader": "#e6a23c",
    "h2d": "#9575cd",
    "forward": "#42a5f5",
    "backward": "#26a69a",
    "optimizer": "#ef5350",
    "wait": "#78909c",
}


# C0 controls, DEL and C1 written as \xNN: a name must neither drive the terminal nor hide.
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}


def clean(text: str) -> str:
    """``text`` with its control characters written out (ESC as ``\\x1b``)."""
    return text.translate(_CONTROLS)


def plain(value: object, style: str = "") -> Text:
    """``value`` as literal text: no markup, no emoji codes, control characters written out.

    Shaped like the Text a DataTable makes of a plain string cell (one line, no end),
    so a table looks the same whichever it is given.
    """
    return Text(clean(str(value)), style=style, no_wrap=True, end="")


def fmt_ms(v: float | None) -> str:
    if v is None:
        return ABSENT
    return f"{v:.0f}" if v >= 1000 else f"{v:.1f}"


def fmt_pct(v: float | None) -> str:
    return ABSENT if v is None else f"{v:.0f}%"


def fmt_num(v: float | None, unit: str = "", digits: int = 0) -> str:
    return ABSENT if v is None else f"{v:.{digits}f}{unit}"


def fmt_bytes(v: float | None) -> str:
    if v is None:
        return ABSENT
    x = float(v)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{x:.1f} TiB"


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return ABSENT
    s = int(max(0.0, seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"


def resample(values: Sequence[float | None], width: int) -> list[float | None]:
    """Fit values into ``width`` columns (bucket mean, None where a bucket has no data).

    The last column always holds the newest values.
    """
    n = len(values)
    if width <= 0 or n == 0:
        return []
    if n <= width:
        return list(values)
    out: list[float | None] = []
    for i in range(width):
        lo = n - math.ceil((width - i) * n / width)
        hi = n - math.ceil((width - i - 1) * n / width)
        chunk = [v for v in values[max(lo, 0) : max(hi, lo + 1)] if v is not None]
        out.append(sum(chunk) / len(chunk) if chunk else None)
    return out


def sparkline(values: Sequence[float | None], width: int, style: str = "#4fc3f7") -> Text:
    """Unicode block sparkline; gaps (None) are drawn as a dim dot."""
    cols = resample(values, width)
    xs = [v for v in cols if v is not None]
    text = Text()
    if not xs:
        text.append(ABSENT, style="dim")
        return text
    lo, hi = min(xs), max(xs)
    span = hi - lo
    for v in cols:
        if v is None:
            text.append("·", style="dim")
        else:
            idx = 0 if span <= 0 else int((v - lo) / span * (len(_BLOCKS) - 1) + 0.5)
            text.append(_BLOCKS[idx], style=style)
    return text


def phase_bar(phases: dict[str, float | None], width: int) -> Text:
    """A one-line stacked bar of phase shares (each phase in its colour)."""
    total = sum(v for v in phases.values() if v)
    text = Text()
    if not total or width <= 0:
        text.append(ABSENT, style="dim")
        return text
    used = 0
    items = [(p, v) for p, v in phases.items() if v]
    for i, (p, v) in enumerate(items):
        n = width - used if i == len(items) - 1 else round(v / total * width)
        n = max(0, min(n, width - used))
        text.append("█" * n, style=PHASE_COLORS.get(p, "white"))
        used += n
    return text


def phase_legend() -> Text:
    text = Text()
    for p, color in PHASE_COLORS.items():
        text.append("■ ", style=color)
        text.append(f"{p}  ")
    return text


def heat_style(value: float | None, ref: float | None) -> str:
    """Background for a rank cell: how far above the run median it is."""
    if value is None or not ref:
        return "on #3a3a3a"
    r = value / ref
    if r < 1.05:
        return "on #2e7d32"
    if r < 1.15:
        return "on #9e9d24"
    if r < 1.3:
        return "on #ef6c00"
    return "on #c62828"


class RankGrid(Widget):
    """A heatmap of one value per rank, readable from 2 to 4096 ranks.

    Few ranks get labelled cells ("r3 43.2"); more get 2- or 1-column blocks;
    beyond ``max_rows`` lines, several ranks share a cell (their maximum, so a
    straggler is never averaged away) and the caption says how many.
    """

    DEFAULT_CSS = """
    RankGrid { height: auto; }
    """

    def __init__(self, *, max_rows: int = 8, id: str | None = None) -> None:
        super().__init__(id=id)
        self.max_rows = max_rows
        self.caption = ""
        self.values: list[tuple[int, float | None]] = []  # (global rank, value), rank order

    def set_values(self, title: str, values: list[tuple[int, float | None]]) -> None:
        self.caption = title
        self.values = values
        self.refresh(layout=True)

    def layout_for(self, width: int) -> tuple[int, int, int]:
        """(cell width, ranks per cell, rows) for ``width`` columns."""
        n = max(1, len(self.values))
        width = max(1, width)
        for cell in (9, 2, 1):
            per_row = max(1, width // cell)
            rows = math.ceil(n / per_row)
            if rows <= (4 if cell == 9 else self.max_rows):
                return cell, 1, rows
        group = math.ceil(n / (width * self.max_rows))
        return 1, group, math.ceil(math.ceil(n / group) / width)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        _, _, rows = self.layout_for(width)
        return rows + 2  # caption + grid + legend

    def render(self) -> Text:
        width = max(1, self.size.width)
        cell, group, _ = self.layout_for(width)
        vals = [v for _, v in self.values if v is not None]
        ref = sorted(vals)[len(vals) // 2] if vals else None
        out = Text()
        caption = f"{self.caption} · {len(self.values)} ranks"
        if group > 1:
            caption += f" · each cell = {group} ranks (max)"
        out.append(caption[:width] + "\n", style="bold")
        per_row = max(1, width // cell)
        cells: list[tuple[str, float | None]] = []
        for i in range(0, len(self.values), group):
            chunk = self.values[i : i + group]
            measured = [v for _, v in chunk if v is not None]
            value = max(measured) if measured else None
            label = f"r{chunk[0][0]} {fmt_ms(value)}" if cell == 9 else ""
            cells.append((label, value))
        # Neighbouring cells of one colour are appended as one span: at 4096 ranks
        # that is a few hundred spans to render instead of thousands.
        run_text, run_style = "", ""
        for i, (label, value) in enumerate(cells):
            style = heat_style(value, ref)
            text = label[: cell - 1].ljust(cell - 1) + " " if cell == 9 else " " * cell
            if i and i % per_row == 0:
                out.append(run_text, style=run_style)
                out.append("\n")
                run_text, run_style = "", ""
            if style != run_style and run_text:
                out.append(run_text, style=run_style)
                run_text = ""
            run_text += text
            run_style = style
        if run_text:
            out.append(run_text, style=run_style)
        out.append("\n")
        legend = Text()
        for label, style in (
            ("≤median", "on #2e7d32"),
            ("+5%", "on #9e9d24"),
            ("+15%", "on #ef6c00"),
            ("+30%", "on #c62828"),
            ("none", "on #3a3a3a"),
        ):
            legend.append("  ", style=style)
            legend.append(f" {label} ")
        out.append_text(legend)
        return out


class SparkList(Widget):
    """Labelled sparklines, one per line, sized to the widget's width.

    Each line: ``label`` (fixed column), the sparkline, then ``suffix``
    (usually the latest value).
    """

    DEFAULT_CSS = """
    SparkList { height: auto; }
    """

    def __init__(self, *, label_width: int = 10, id: str | None = None) -> None:
        super().__init__(id=id)
        self.label_width = label_width
        self.lines: list[tuple[str, list[float | None], str, str]] = []

    def set_lines(self, lines: list[tuple[str, list[float | None], str, str]]) -> None:
        """``lines``: (label, values, suffix, colour)."""
        self.lines = lines
        self.refresh(layout=True)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return max(1, len(self.lines))

    def render(self) -> Text:
        width = max(1, self.size.width)
        out = Text()
        if not self.lines:
            out.append(ABSENT, style="dim")
            return out
        for i, (label, values, suffix, color) in enumerate(self.lines):
            if i:
                out.append("\n")
            out.append(clean(label)[: self.label_width].ljust(self.label_width), style="bold")
            room = max(1, width - self.label_width - len(suffix) - 2)
            out.append_text(sparkline(values, room, style=color))
            out.append(f" {suffix}")
        return out
