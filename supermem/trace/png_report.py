"""The report's main plot as a PNG, for terminals (e.g. kitty/iTerm image protocols) and CI logs:
per device, memory over time stacked by category with reserved as a line, the peak, OOMs and a strip
of pool activity."""

from __future__ import annotations

import os
from pathlib import Path

from ..units import format_bytes
from .analysis import DeviceReport, Report
from .output import write_bytes
from .png import GLYPH_H, GLYPH_W, Canvas, hex_color
from .svg_plot import RESERVED_COLOR, color_of, nice_bytes_step

WIDTH = 1000
PANEL_H = 300
LEFT, RIGHT, TOP = 80, 14, 24
PLOT_H = 200
STRIP_H = 12  # pool activity strip under the plot


def render(rep: Report) -> Canvas:
    panels = rep.devices or []
    c = Canvas(WIDTH, 30 + PANEL_H * max(1, len(panels)))
    c.text(8, 8, f"SUPERMEM MEMORY REPORT  {rep.source}  {rep.num_events} EVENTS", scale=2)
    if not panels:
        c.text(8, 40, "NO DEVICE EVENTS AND NO SNAPSHOT")
    for k, d in enumerate(panels):
        _panel(c, rep, d, 30 + k * PANEL_H)
    return c


def _panel(c: Canvas, rep: Report, d: DeviceReport, y_top: int) -> None:
    gray, dark = (200, 200, 200), (60, 60, 60)
    head = f"DEVICE {d.device}  PEAK ACTIVE {format_bytes(d.peak_bytes)}"
    head += f"  PEAK RESERVED {format_bytes(d.peak_reserved_bytes)}"
    if d.ooms:
        head += f"  OOMS {len(d.ooms)}"
    c.text(8, y_top + 4, head, dark)
    x0, x1 = LEFT, WIDTH - RIGHT
    y0, y1 = y_top + TOP, y_top + TOP + PLOT_H  # y1 is the baseline
    n = len(d.active)
    y_max = max(max(d.reserved, default=0), max(d.active, default=0), 1) * 1.05
    step = nice_bytes_step(y_max, 4)

    def ypix(v: float) -> int:
        return y1 - int(round(min(v, y_max) / y_max * PLOT_H))

    v = 0.0
    while v <= y_max:
        y = ypix(v)
        c.fill_rect(x0, y, x1, y + 1, (235, 235, 235))
        label = format_bytes(v)
        c.text(x0 - 4 - GLYPH_W * len(label), y - GLYPH_H // 2, label)
        v += step
    cats = list(d.by_category.items())
    colors = [hex_color(color_of(k, i)) for i, (k, _) in enumerate(cats)]
    reserved_color = hex_color(RESERVED_COLOR)
    totals = [sum(vals[i] for _, vals in cats) for i in range(n)]

    def bins(x: int) -> range:
        """The bins pixel column x covers (there are more bins than columns)."""
        lo = min(n - 1, (x - x0) * n // (x1 - x0))
        return range(lo, max(lo + 1, min(n, (x + 1 - x0) * n // (x1 - x0))))

    prev_r = None
    for x in range(x0, x1):
        # The column shows its tallest bin: sampling one bin per column would drop narrow peaks.
        i = max(bins(x), key=totals.__getitem__) if n else 0
        base = 0
        for (_, vals), col in zip(cats, colors, strict=True):
            top = base + vals[i]
            if vals[i]:
                c.fill_rect(x, ypix(top), x + 1, ypix(base), col)
            base = top
        r = ypix(max(d.reserved[j] for j in bins(x))) if n else y1
        if prev_r is not None:
            c.line(x - 1, prev_r, x, r, reserved_color)
        prev_r = r
    c.fill_rect(x0, y0, x0 + 1, y1 + 1, dark)
    c.fill_rect(x0, y1, x1, y1 + 1, dark)
    span = rep.span_s
    for frac in (0.0, 0.25, 0.5, 0.75, 1.0):
        label = f"{frac * span * 1e6:.0f}" if rep.time_is_index else _seconds(frac * span)
        x = x0 + int(frac * (x1 - x0 - 1))
        c.fill_rect(x, y1, x + 1, y1 + 4, dark)
        c.text(min(x - GLYPH_W * len(label) // 2, WIDTH - GLYPH_W * len(label)), y1 + 6, label)
    if d.peak_time_s is not None and rep.span_s:
        px = x0 + int(d.peak_time_s / rep.span_s * (x1 - x0 - 1))
        for y in range(y0, y1, 4):
            c.fill_rect(px, y, px + 1, y + 2, (200, 0, 0))
    for o in d.ooms:
        ox = x0 + int(o["time_s"] / max(rep.span_s, 1e-12) * (x1 - x0 - 1))
        c.fill_rect(ox - 1, y0, ox + 1, y1, (0, 0, 0))
    # pool strip: offloads red, copies to the device blue, other actions gray
    ys = y1 + 18
    if d.pool_bytes:
        c.text(8, ys + 2, "POOL")
        for x in range(x0, x1):
            for name, per_bin in d.pool_bytes.items():
                if any(per_bin[j] > 0 for j in bins(x)):
                    col = (
                        (225, 87, 89)
                        if name == "offload"
                        else (78, 121, 167)
                        if name in ("prefetch", "restore")
                        else gray
                    )
                    c.fill_rect(x, ys, x + 1, ys + STRIP_H, col)
    # legend
    x = x0
    yl = ys + STRIP_H + 8
    for (k, _), col in zip(cats, colors, strict=True):
        c.fill_rect(x, yl, x + 9, yl + 7, col)
        x = c.text(x + 12, yl, k) + 12
    c.fill_rect(x, yl + 3, x + 9, yl + 5, reserved_color)
    c.text(x + 12, yl, "reserved")


def _seconds(s: float) -> str:
    return f"{s:.3g}S" if s >= 1 or s == 0 else f"{s * 1e3:.3g}MS"


def write_png(rep: Report, path: str | os.PathLike) -> Path:
    return write_bytes(path, render(rep).to_png())
