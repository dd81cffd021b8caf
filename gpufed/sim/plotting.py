"""A line chart as a PNG, in pure Python (no matplotlib): `gpufed simulate`'s allocation plot.

Draws one line per series on a grid, with axis numbers and a legend in a tiny 3×5 bitmap
font (upper-case letters, digits and a few signs), and writes an 8-bit RGB PNG with zlib.
"""

from __future__ import annotations

import itertools
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

Color = tuple[int, int, int]

PALETTE: tuple[Color, ...] = (
    (31, 119, 180),
    (214, 39, 40),
    (44, 160, 44),
    (255, 127, 14),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (23, 190, 207),
)

# 3×5 glyphs: five rows of three bits, top row first
_FONT: dict[str, tuple[int, ...]] = {
    "0": (7, 5, 5, 5, 7), "1": (2, 6, 2, 2, 7), "2": (7, 1, 7, 4, 7), "3": (7, 1, 7, 1, 7),
    "4": (5, 5, 7, 1, 1), "5": (7, 4, 7, 1, 7), "6": (7, 4, 7, 5, 7), "7": (7, 1, 1, 1, 1),
    "8": (7, 5, 7, 5, 7), "9": (7, 5, 7, 1, 7), "A": (2, 5, 7, 5, 5), "B": (6, 5, 6, 5, 6),
    "C": (3, 4, 4, 4, 3), "D": (6, 5, 5, 5, 6), "E": (7, 4, 6, 4, 7), "F": (7, 4, 6, 4, 4),
    "G": (3, 4, 5, 5, 3), "H": (5, 5, 7, 5, 5), "I": (7, 2, 2, 2, 7), "J": (1, 1, 1, 5, 2),
    "K": (5, 5, 6, 5, 5), "L": (4, 4, 4, 4, 7), "M": (5, 7, 7, 5, 5), "N": (6, 5, 5, 5, 5),
    "O": (2, 5, 5, 5, 2), "P": (6, 5, 6, 4, 4), "Q": (2, 5, 5, 6, 3), "R": (6, 5, 6, 5, 5),
    "S": (3, 4, 2, 1, 6), "T": (7, 2, 2, 2, 2), "U": (5, 5, 5, 5, 7), "V": (5, 5, 5, 5, 2),
    "W": (5, 5, 7, 7, 5), "X": (5, 5, 2, 5, 5), "Y": (5, 5, 2, 2, 2), "Z": (7, 1, 2, 4, 7),
    "-": (0, 0, 7, 0, 0), ".": (0, 0, 0, 0, 2), "%": (5, 1, 2, 4, 5), " ": (0, 0, 0, 0, 0),
    "(": (1, 2, 2, 2, 1), ")": (4, 2, 2, 2, 4), "/": (1, 1, 2, 4, 4), ":": (0, 2, 0, 2, 0),
    "=": (0, 7, 0, 7, 0), ",": (0, 0, 0, 2, 4), "_": (0, 0, 0, 0, 7),
}  # fmt: skip


class Canvas:
    """An RGB raster with the few drawing operations a line chart needs."""

    def __init__(self, width: int, height: int, *, background: Color = (255, 255, 255)) -> None:
        self.width = width
        self.height = height
        self.pixels = bytearray(bytes(background) * (width * height))

    def dot(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            at = 3 * (y * self.width + x)
            self.pixels[at : at + 3] = bytes(color)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        for y in range(max(0, y0), min(self.height, y1 + 1)):
            for x in range(max(0, x0), min(self.width, x1 + 1)):
                self.dot(x, y, color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, *, width: int = 1) -> None:
        """Bresenham's line, `width` pixels thick."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        half = width // 2
        while True:
            for ox in range(-half, width - half):
                for oy in range(-half, width - half):
                    self.dot(x0 + ox, y0 + oy, color)
            if x0 == x1 and y0 == y1:
                return
            twice = 2 * err
            if twice >= dy:
                err += dy
                x0 += sx
            if twice <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, words: str, color: Color, *, scale: int = 2) -> int:
        """Write `words` (upper-cased) with its top-left at (x, y); returns the end x."""
        for char in words.upper():
            glyph = _FONT.get(char, _FONT[" "])
            for row, bits in enumerate(glyph):
                for col in range(3):
                    if bits & (4 >> col):
                        self.rect(x + col * scale, y + row * scale,
                                  x + col * scale + scale - 1, y + row * scale + scale - 1,
                                  color)  # fmt: skip
            x += 4 * scale
        return x

    def to_png(self) -> bytes:
        raw = b"".join(
            b"\x00" + bytes(self.pixels[3 * y * self.width : 3 * (y + 1) * self.width])
            for y in range(self.height)
        )

        def chunk(kind: bytes, data: bytes) -> bytes:
            body = kind + data
            return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(raw, 9))
            + chunk(b"IEND", b"")
        )


def plot_lines(
    path: Path,
    series: Sequence[tuple[str, Sequence[tuple[float, float]]]],
    *,
    title: str,
    x_range: tuple[float, float],
    y_range: tuple[float, float],
    x_step: float,
    y_step: float,
    x_label: str,
    y_label: str,
    size: tuple[int, int] = (900, 560),
) -> None:
    """Write a PNG line chart of `series` ((name, [(x, y), ...]), ...) to `path`."""
    width, height = size
    canvas = Canvas(width, height)
    left, right, top, bottom = 70, width - 20, 40, height - 50
    (x0, x1), (y0, y1) = x_range, y_range

    def px(x: float) -> int:
        return round(left + (x - x0) / (x1 - x0) * (right - left))

    def py(y: float) -> int:
        return round(bottom - (y - y0) / (y1 - y0) * (bottom - top))

    grid, ink = (225, 225, 225), (60, 60, 60)
    steps = round((x1 - x0) / x_step)
    for i in range(steps + 1):
        x = x0 + i * x_step
        canvas.line(px(x), top, px(x), bottom, grid)
        canvas.text(px(x) - 8, bottom + 8, f"{x:g}", ink)
    steps = round((y1 - y0) / y_step)
    for i in range(steps + 1):
        y = y0 + i * y_step
        canvas.line(left, py(y), right, py(y), grid)
        canvas.text(8, py(y) - 5, f"{y:g}", ink)
    canvas.line(left, bottom, right, bottom, ink)
    canvas.line(left, top, left, bottom, ink)
    canvas.text(left, 12, title, ink)
    canvas.text((left + right) // 2 - 4 * 2 * len(x_label) // 2, height - 22, x_label, ink)
    canvas.text(left + 6, top + 6, y_label, ink)
    for number, (name, points) in enumerate(series):
        color = PALETTE[number % len(PALETTE)]
        inside = [(x, y) for x, y in points if x0 <= x <= x1 and y0 <= y <= y1]
        for (xa, ya), (xb, yb) in itertools.pairwise(inside):
            canvas.line(px(xa), py(ya), px(xb), py(yb), color, width=2)
        legend_y = bottom - 20 - 16 * (len(series) - 1 - number)
        canvas.rect(right - 190, legend_y, right - 178, legend_y + 9, color)
        canvas.text(right - 170, legend_y, name, ink)
    path.write_bytes(canvas.to_png())
