"""Plain-text tables for benchmark rows (dicts); a missing or None value prints as "-"."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Column = tuple[str, Callable[[dict], Any], str]  # header, value of a row, format spec ("" = str)


def cell(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    if spec and isinstance(value, (int, float)):
        return format(value, spec)
    return str(value)


def render(columns: Sequence[Column], rows: Sequence[dict]) -> str:
    grid = [[h for h, _, _ in columns]]
    for row in rows:
        grid.append([cell(_get(get, row), spec) for _, get, spec in columns])
    widths = [max(len(r[i]) for r in grid) for i in range(len(columns))]
    lines = []
    for n, r in enumerate(grid):
        first = r[0].ljust(widths[0])
        lines.append("  ".join([first] + [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _get(get: Callable[[dict], Any], row: dict) -> Any:
    try:
        return get(row)
    except (KeyError, TypeError, ZeroDivisionError):
        return None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing."""
    if a is None or not b:
        return None
    return a / b
