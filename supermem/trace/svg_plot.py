"""Small SVG plots for the HTML report, drawn server-side from already-downsampled series, so the
page needs no plotting library and its size does not grow with the trace."""

from __future__ import annotations

import html
import math
import re
from collections.abc import Sequence

from ..units import format_bytes

# Tableau 10, the palette memory_viz uses; one colour per category in CATEGORIES order.
CATEGORY_COLORS = {
    "parameter": "#4e79a7",
    "gradient": "#f28e2c",
    "optimizer_state": "#e15759",
    "activation": "#76b7b2",
    "input": "#59a14f",
    "temporary": "#edc949",
    "autograd_detail": "#b07aa1",
    "unknown": "#bab0ab",
}
EXTRA_COLORS = ("#ff9da7", "#9c755f", "#17becf", "#8c564b")
RESERVED_COLOR = "#333333"

W, H = 1000, 260  # viewBox of every plot
LEFT, RIGHT, TOP, BOTTOM = 78, 12, 10, 26  # margins for the axes' labels


def css_token(name: str) -> str:
    """A name from a trace as one CSS class token: a category may be any string."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", name)


def attr(value: object) -> str:
    """A value for a double-quoted attribute."""
    return html.escape(str(value), quote=True)


def color_of(category: str, i: int = 0) -> str:
    return CATEGORY_COLORS.get(category, EXTRA_COLORS[i % len(EXTRA_COLORS)])


def nice_step(span: float, ticks: int = 5) -> float:
    """A 1/2/5 x 10^k step giving about `ticks` ticks over `span`."""
    if span <= 0:
        return 1.0
    raw = span / ticks
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def nice_bytes_step(span: float, ticks: int = 5) -> float:
    """A power-of-two-friendly step for byte axes (so labels read 2.00 GiB, not 2.15 GiB)."""
    if span <= 0:
        return 1.0
    raw = span / ticks
    unit = 1 << (10 * max(0, int(math.log2(max(raw, 1)) // 10)))
    return nice_step(raw * ticks / unit, ticks) * unit


class Plot:
    """One SVG plot: x is a bin index [0, n), y a value [0, y_max]."""

    def __init__(
        self,
        n: int,
        y_max: float,
        css_class: str,
        y_label=format_bytes,
        x_label=None,
        x_max=1.0,
        grid: bool = True,
    ):
        self.n = max(n, 1)
        self.y_max = y_max if y_max > 0 else 1.0
        self.css_class = css_class
        self.y_label = y_label
        self.x_label = x_label or (lambda x: f"{x:.3g} s")
        self.x_max = x_max
        self.grid = grid
        self.parts: list[str] = []

    def x(self, i: float) -> float:
        return LEFT + (W - LEFT - RIGHT) * (i / max(self.n - 1, 1))

    def y(self, v: float) -> float:
        return TOP + (H - TOP - BOTTOM) * (1 - min(v, self.y_max) / self.y_max)

    def points(self, values: Sequence[float], reverse: bool = False) -> str:
        """'x,y' pairs of a polyline through `values`, without the middle points of flat runs (they
        change nothing drawn and are most of a memory series)."""
        n = len(values)
        keep = [
            i for i in range(n) if i in (0, n - 1) or values[i] != values[i - 1] or values[i] != values[i + 1]
        ]
        if reverse:
            keep.reverse()
        return " ".join(f"{self.x(i):.1f},{self.y(values[i]):.1f}" for i in keep)

    def area(self, lower: Sequence[float], upper: Sequence[float], color: str, css: str, title: str) -> None:
        top = self.points(upper)
        bottom = self.points(lower, reverse=True)
        self.parts.append(
            f'<polygon class="area {attr(css)}" fill="{attr(color)}" points="{top} {bottom}">'
            f"<title>{html.escape(title)}</title></polygon>"
        )

    def line(self, values: Sequence[float], color: str, css: str, dash: str = "") -> None:
        pts = self.points(values)
        d = f' stroke-dasharray="{dash}"' if dash else ""
        self.parts.append(
            f'<polyline class="line {attr(css)}" fill="none" stroke="{attr(color)}" stroke-width="1.5"{d} '
            f'points="{pts}"/>'
        )

    def bars(self, values: Sequence[float], color: str, css: str, y0: float, y1: float, v_max: float) -> None:
        """Bars in a lane from y0 (bottom) to y1 (top), heights relative to v_max."""
        w = (W - LEFT - RIGHT) / self.n
        out = []
        for i, v in enumerate(values):
            if v > 0:
                h = max(1.0, (y0 - y1) * v / v_max)
                out.append(f"M{LEFT + i * w:.1f},{y0:.1f}v{-h:.1f}h{max(w, 1):.1f}v{h:.1f}z")
        if out:
            self.parts.append(f'<path class="bars {attr(css)}" fill="{attr(color)}" d="{"".join(out)}"/>')

    def marker(self, i: float, text: str, color: str = "#c00", css: str = "marker") -> None:
        """A dashed vertical line, drawn under the data (a one-bin peak must stay visible)."""
        x = self.x(i)
        self.parts.insert(
            0,
            f'<line class="{attr(css)}" x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{H - BOTTOM}" '
            f'stroke="{attr(color)}" stroke-dasharray="4 3"><title>{html.escape(text)}</title></line>',
        )

    def band(self, i0: float, i1: float, color: str, css: str, title: str) -> None:
        """A shaded span of bins, drawn under everything (a phase of the step)."""
        x0, x1 = self.x(i0), self.x(i1)
        self.parts.insert(
            0,
            f'<rect class="{attr(css)}" x="{x0:.1f}" y="{TOP}" width="{max(x1 - x0, 0.5):.1f}" '
            f'height="{H - TOP - BOTTOM}" fill="{attr(color)}"><title>{html.escape(title)}</title></rect>',
        )

    def svg(self, label: str) -> str:
        axes = []
        step = nice_bytes_step(self.y_max) if self.y_label is format_bytes else nice_step(self.y_max)
        v = 0.0 if self.grid else self.y_max * 2  # no value axis: skip the loop
        while v <= self.y_max * 1.0001:
            y = self.y(v)
            axes.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
            axes.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{self.y_label(v)}</text>')
            v += step
        xstep = nice_step(self.x_max, 8)
        xv = 0.0
        while xv <= self.x_max * 1.0001:
            x = self.x(xv / self.x_max * (self.n - 1)) if self.x_max else LEFT
            axes.append(f'<text x="{x:.1f}" y="{H - 8}" text-anchor="middle">{self.x_label(xv)}</text>')
            xv += xstep
        axes.append(f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{H - BOTTOM}" class="axis"/>')
        axes.append(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{H - BOTTOM}" y2="{H - BOTTOM}" class="axis"/>')
        cursor = f'<line class="cursor" x1="0" x2="0" y1="{TOP}" y2="{H - BOTTOM}" visibility="hidden"/>'
        return (
            f'<svg class="plot {attr(self.css_class)}" viewBox="0 0 {W} {H}" role="img" '
            f'aria-label="{attr(label)}">' + "".join(axes) + "".join(self.parts) + cursor + "</svg>"
        )
