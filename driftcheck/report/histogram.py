"""The error histogram of a detail in the HTML report: a static inline SVG, drawn here.

Bars over log10 |target - reference| (the bins ``ErrorAccumulator.histogram`` made), the noise
floor as a dashed line, a few ticks. Text stays text (escaped), no script, no external
reference, ids unneeded: several charts share a page. A few kilobytes a chart, drawn in well
under a millisecond (matplotlib took ~15 KB and, with its import, about a second per report).
"""
from __future__ import annotations

import math
from typing import Any
from xml.sax.saxutils import escape, quoteattr

from driftcheck.report.common import as_float

WIDTH, HEIGHT = 420, 190
LEFT, RIGHT, TOP, BOTTOM = 52, 12, 16, 36  # margins: tick labels left and below
BAR = "#0072B2"
FLOOR = "#D55E00"
AXIS = "#888888"
INK = "#333333"


def histogram_svg(hist: dict[str, Any], floor: float | None, label: str = "error histogram") -> str:
    """``hist`` (edges, counts) as an inline ``<svg class="chart">``; "" where it holds no bins or
    an edge is not finite."""
    edges = [as_float(x) for x in hist.get("edges", [])]
    counts = [as_float(x) or 0.0 for x in hist.get("counts", [])]
    if len(edges) != len(counts) + 1 or not counts or any(x is None or not math.isfinite(x) for x in edges):
        return ""
    ends = [float(x) for x in edges if x is not None]
    lo, hi = ends[0], ends[-1]
    log_floor = math.log10(floor) if floor is not None and floor > 0 and math.isfinite(floor) else None
    if log_floor is not None:
        lo, hi = min(lo, log_floor - 0.5), max(hi, log_floor + 0.5)
    if hi <= lo:
        hi = lo + 1.0
    top = max(max(counts), 1.0)
    w, h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(v: float) -> float:
        return LEFT + (v - lo) / (hi - lo) * w

    def y(c: float) -> float:
        return TOP + h - c / top * h

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" class="chart" '
             f'role="img" aria-label={quoteattr(label)} font-family="sans-serif" font-size="9">']
    for a, b, c in zip(ends, ends[1:], counts, strict=False):
        if c > 0:
            parts.append(f'<rect x="{x(a):.1f}" y="{y(c):.1f}" width="{max(x(b) - x(a), 0.5):.1f}" '
                         f'height="{TOP + h - y(c):.1f}" fill="{BAR}" fill-opacity="0.8"/>')
    base = TOP + h
    parts.append(f'<path d="M{LEFT} {TOP}V{base}H{LEFT + w}" fill="none" stroke="{AXIS}"/>')
    for t in _ticks(lo, hi):
        parts.append(f'<path d="M{x(t):.1f} {base}v4" stroke="{AXIS}"/>'
                     f'<text x="{x(t):.1f}" y="{base + 14}" text-anchor="middle" fill="{INK}">{t:g}</text>')
    for c in (0, top):
        parts.append(f'<text x="{LEFT - 5}" y="{y(c) + 3:.1f}" text-anchor="end" fill="{INK}">{c:g}</text>')
    parts.append(f'<text x="{LEFT + w / 2:.1f}" y="{HEIGHT - 4}" text-anchor="middle" fill="{INK}">'
                 f'{escape("log10 |target − reference|")}</text>')
    parts.append(f'<text transform="translate(12 {TOP + h / 2:.1f}) rotate(-90)" text-anchor="middle" '
                 f'fill="{INK}">elements</text>')
    if log_floor is not None:
        fx = x(log_floor)
        parts.append(f'<path d="M{fx:.1f} {TOP}V{base}" stroke="{FLOOR}" stroke-width="1.2" '
                     f'stroke-dasharray="4 3"/><text x="{fx:.1f}" y="{TOP - 4}" text-anchor="middle" '
                     f'fill="{FLOOR}" font-size="8">floor</text>')
    parts.append("</svg>")
    return "".join(parts)


def _ticks(lo: float, hi: float) -> list[int]:
    """Whole decades between ``lo`` and ``hi``, at most about seven of them."""
    step = max(1, math.ceil((hi - lo) / 7))
    first = math.ceil(lo / step) * step
    return list(range(first, math.floor(hi) + 1, step))
