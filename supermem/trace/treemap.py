"""The peak as a treemap: one rectangle per (category, module), area its bytes, coloured by category.
Static SVG (squarified layout, Bruls et al. 2000) drawn here: the report's policy runs no library and
no inline style, and its size does not grow with the trace (breakdown.MAX_OWNERS rectangles at most)."""

from __future__ import annotations

import html
from typing import Any

from ..units import format_bytes
from .svg_plot import attr, color_of

W, H = 1000, 320


def _worst(row: list[float], side: float) -> float:
    s = sum(row)
    return max(max(side * side * r / (s * s), s * s / (side * side * r)) for r in row)


def squarify(values: list[float], x: float, y: float, w: float, h: float) -> list[tuple[float, ...]]:
    """(x, y, w, h) per value (values > 0, largest first), filling the rectangle."""
    total = sum(values)
    if not values or total <= 0:
        return []
    scale = w * h / total
    areas = [v * scale for v in values]
    out: list[tuple[float, ...]] = []
    i = 0
    while i < len(areas):
        side = min(w, h)
        row = [areas[i]]
        j = i + 1
        while j < len(areas) and _worst([*row, areas[j]], side) <= _worst(row, side):
            row.append(areas[j])
            j += 1
        s = sum(row)
        if w >= h:  # a column on the left
            cw = s / h if h else 0
            cy = y
            for a in row:
                out.append((x, cy, cw, a / cw if cw else 0))
                cy += a / cw if cw else 0
            x, w = x + cw, w - cw
        else:  # a row on top
            rh = s / w if w else 0
            cx = x
            for a in row:
                out.append((cx, y, a / rh if rh else 0, rh))
                cx += a / rh if rh else 0
            y, h = y + rh, h - rh
        i = j
    return out


def svg(rows: list[dict[str, Any]], total_bytes: int, label: str) -> str:
    """The treemap of `rows` ({category, module, bytes}, largest first)."""
    rows = [r for r in rows if r["bytes"] > 0]
    rects = squarify([float(r["bytes"]) for r in rows], 0, 0, W, H)
    parts = []
    for r, (x, y, w, h) in zip(rows, rects, strict=True):
        share = r["bytes"] / total_bytes if total_bytes else 0
        name = f"{r['category']} · {r['module']}"
        tip = f"{name}: {format_bytes(r['bytes'])} ({share:.1%})"
        parts.append(
            f'<rect class="tile" x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" '
            f'fill="{attr(color_of(r["category"]))}" stroke="#fff"><title>{html.escape(tip)}</title></rect>'
        )
        if w > 90 and h > 28:
            fit = int(w / 6.5)
            parts.append(
                f'<text x="{x + 4:.1f}" y="{y + 13:.1f}">{html.escape(name[:fit])}</text>'
                f'<text x="{x + 4:.1f}" y="{y + 26:.1f}">{format_bytes(r["bytes"])} ({share:.0%})</text>'
            )
    return (
        f'<svg class="plot treemap" viewBox="0 0 {W} {H}" role="img" aria-label="{attr(label)}">'
        + "".join(parts)
        + "</svg>"
    )
