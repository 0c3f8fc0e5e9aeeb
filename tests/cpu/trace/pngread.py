"""A PNG decoder for tests (8-bit RGB/RGBA, all five filters), written from the PNG spec, not from
supermem's encoder: it reads Chromium's screenshots as well as supermem's PNGs."""

from __future__ import annotations

import struct
import zlib


def read_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB bytes)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in {kind!r}"
        if kind == b"IHDR":
            width, height, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and ctype in (2, 6) and interlace == 0, (depth, ctype, interlace)
            bpp = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat += body
        elif kind == b"IEND":
            break
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 0xFF
            elif f == 2:
                line[i] = (line[i] + b) & 0xFF
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                line[i] = (line[i] + pred) & 0xFF
            else:
                assert f == 0, f"bad filter {f}"
        prev = line
        if bpp == 4:
            rows.append(bytes(v for j in range(0, stride, 4) for v in line[j : j + 3]))
        else:
            rows.append(bytes(line))
    return width, height, rows


def color_counts(rows: list[bytes], step: int = 1) -> dict[tuple[int, int, int], int]:
    """Pixel counts per colour (every `step`-th pixel of every `step`-th row)."""
    out: dict[tuple[int, int, int], int] = {}
    for row in rows[::step]:
        for i in range(0, len(row), 3 * step):
            c = (row[i], row[i + 1], row[i + 2])
            out[c] = out.get(c, 0) + 1
    return out


def has_color_near(counts: dict, rgb: tuple[int, int, int], tol: int = 12, min_pixels: int = 20) -> bool:
    n = sum(v for c, v in counts.items() if all(abs(c[k] - rgb[k]) <= tol for k in range(3)))
    return n >= min_pixels
