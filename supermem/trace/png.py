"""A tiny RGB raster with a 5x7 pixel font, encoded as PNG with zlib and struct only.

Why not matplotlib: it is a large dependency for a handful of filled columns, lines and labels, and
PNG output must work on CI machines and servers that only have supermem's own dependencies.
"""

from __future__ import annotations

import struct
import zlib

Color = tuple[int, int, int]

# 5x7 glyphs: a character, then 7 rows as two hex digits each (bit 4 = leftmost pixel).
_FONT_DATA = (
    "00e11131519110e1040c040404040e20e11010204081f31f02040201110e402060a121f020251f101e0101110e6060810"
    "1e11110e71f01020408080880e11110e11110e90e11110f01020cA0e11111f111111B1e11111e11111eC0e11101010110e"
    "D1c12111111121cE1f10101e10101fF1f10101e101010G0e11101711110fH1111111f111111I0e04040404040eJ0702020"
    "202120cK11121418141211L1010101010101fM111b1515111111N11111915131111O0e11111111110eP1e11111e101010Q"
    "0e11111115120dR1e11111e141211S0f10100e01011eT1f040404040404U1111111111110eV11111111110a04W11111115"
    "15150aX11110a040a1111Y11110a04040404Z1f01020408101f.00000000000c0c,000000000c0408:000c0c000c0c00%"
    "18190204081303/00010204081000-0000001f000000_0000000000001f(02040808080402)08040202020408=00001f001"
    "f0000+0004041f040400>08040201020408<02040810080402#0a0a1f0a1f0a0a*0004150e150400"
)
FONT: dict[str, tuple[int, ...]] = {
    _FONT_DATA[i]: tuple(int(_FONT_DATA[i + 1 + 2 * r : i + 3 + 2 * r], 16) for r in range(7))
    for i in range(0, len(_FONT_DATA), 15)
}
GLYPH_W, GLYPH_H = 6, 8  # advance and line height, in pixels at scale 1


def hex_color(text: str) -> Color:
    text = text.lstrip("#")
    return (int(text[0:2], 16), int(text[2:4], 16), int(text[4:6], 16))


class Canvas:
    """width x height RGB pixels, origin top-left."""

    def __init__(self, width: int, height: int, background: Color = (255, 255, 255)):
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def fill_rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """Fills [x0, x1) x [y0, y1), clipped."""
        x0, x1 = max(0, x0), min(self.width, x1)
        y0, y1 = max(0, y0), min(self.height, y1)
        if x0 >= x1:
            return
        row = bytes(color) * (x1 - x0)
        for y in range(y0, y1):
            i = 3 * (y * self.width + x0)
            self.pixels[i : i + len(row)] = row

    def set(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i : i + 3] = bytes(color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """Bresenham, both ends included."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            self.set(x0, y0, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, s: str, color: Color = (40, 40, 40), scale: int = 1) -> int:
        """Draws `s` (upper-cased; unknown characters as blanks) with its top-left at (x, y). Returns
        the x after the last character."""
        for ch in s.upper():
            rows = FONT.get(ch)
            if rows is not None:
                for r, bits in enumerate(rows):
                    for c in range(5):
                        if bits & (0x10 >> c):
                            self.fill_rect(
                                x + c * scale, y + r * scale, x + (c + 1) * scale, y + (r + 1) * scale, color
                            )
            x += GLYPH_W * scale
        return x

    def to_png(self) -> bytes:
        raw = bytearray()
        stride = 3 * self.width
        for y in range(self.height):
            raw.append(0)  # filter type None
            raw += self.pixels[y * stride : (y + 1) * stride]

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        ihdr = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        return (
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(bytes(raw), 6))
            + chunk(b"IEND", b"")
        )
