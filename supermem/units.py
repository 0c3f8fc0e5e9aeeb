"""Byte sizes: parsing ("8GiB", "512MB", "60%") and formatting."""

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1000**4,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$", re.ASCII)
MAX_BYTES = 2**63 - 1  # what the allocator's sizes (and PyTorch's) can hold
# The smallest fraction of a device or host taken (0.01%: 14 MB of a 141 GB H200). Less is a slip (1e-300%,
# 0.0000000001) that would resolve to a few bytes or none, silently; bytes say a tiny size on purpose.
MIN_FRACTION = 1e-4


def _checked(n: int, value: object) -> int:
    if n > MAX_BYTES:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:30] + "..."
        raise ValueError(f"{shown} is too large: a size is at most 2**63-1 bytes")
    return n


def parse_bytes(value: int | float | str, total_bytes: int | None = None) -> int:
    """Bytes from an int, a size string ("64KiB", "1.5GiB", "512MB") or, when `total_bytes` is given,
    a fraction of it ("60%" or a float 0 < x <= 1). Raises ValueError with the accepted forms."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size must be >= 0, got {value}")
        return _checked(value, value)
    if isinstance(value, float):
        if total_bytes is not None and 0 < value <= 1:
            return int(_fraction(value, repr(value)) * total_bytes)
        raise ValueError(f"a float size must be a fraction in (0, 1] of the device, got {value}")
    text = str(value).strip()
    if text.endswith("%"):
        if total_bytes is None:
            raise ValueError(f"{text!r}: a percentage needs a known device capacity")
        try:
            pct = float(text[:-1])
        except ValueError:
            pct = -1.0
        if not 0 < pct <= 100:
            raise ValueError(f"{text!r}: a percentage must be in (0, 100]")
        return int(total_bytes * _fraction(pct / 100, text))
    m = _SIZE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"{text!r} is not a size: use bytes (1048576), a unit (64KiB, 8GiB, 512MB) or a percentage"
        )
    # exact integer arithmetic: a float would turn 400 digits into inf (OverflowError) and round others
    # (and fractions.Fraction would add an import to every `import torch` under SUPERMEM=1)
    whole, _, frac = m.group(1).partition(".")
    scaled = int(whole or "0") * 10 ** len(frac) + int(frac or "0")
    return _checked(scaled * _UNITS[m.group(2).lower()] // 10 ** len(frac), text)


def _fraction(f: float, shown: str) -> float:
    if f < MIN_FRACTION * (1 - 1e-9):  # "0.01%" is 0.01 / 100, which may round below
        raise ValueError(
            f"{shown} is nearly 0 bytes: a fraction is at least {MIN_FRACTION:g} ({MIN_FRACTION:.2%}); "
            "give bytes for less"
        )
    return f


def format_bytes(n: int | float) -> str:
    """'1.50 GiB' style, binary units."""
    v = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(v) < 1024 or unit == "PiB":
            return f"{int(v)} bytes" if unit == "bytes" else f"{v:.2f} {unit}"
        v /= 1024
    raise AssertionError("unreachable")
