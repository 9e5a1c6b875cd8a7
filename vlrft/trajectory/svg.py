"""Tiny hand-written SVG charts for the offline report: no plotting library, no script.

Each function returns one inline `<svg>` element for an HTML page (inline SVG in HTML needs no
xmlns, and leaving it out keeps the page free of any http:// string). Every piece of text is
HTML-escaped. Non-finite values are dropped; empty input draws a "no data" panel; a single
point or constant values get a padded axis instead of a zero-width one.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass

WIDTH = 560
PLOT_HEIGHT = 200
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 62, 18, 34, 42
LEGEND_ROW = 18
TICK_COUNT = 5
# Okabe-Ito colours (distinguishable with colour-blindness), cycled past eight series.
PALETTE = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442")
# Past this many points per series, dot markers would bury the line.
MAX_MARKED_POINTS = 60
# Run events marked on the curves (the guards' collapse, plateau and rollback steps): a dashed
# vertical line each, in the event's colour, and one legend row per kind.
EVENT_COLOURS = {"collapse": "#D55E00", "plateau": "#E69F00", "rollback": "#000000"}


def esc(text) -> str:
    return html.escape(str(text), quote=True)


def tick_label(value: float) -> str:
    return f"{value:.4g}"


def padded_range(values: list[float]) -> tuple[float, float]:
    """(min, max) of `values`, widened when they are all equal so the axis has a length (not
    below 0 for non-negative values: most plotted statistics are counts and fractions)."""
    lo, hi = min(values), max(values)
    if lo == hi:
        pad = abs(lo) * 0.1 or 0.5
        lo, hi = (lo - pad if lo - pad >= 0 or lo < 0 else 0.0), hi + pad
    return lo, hi


def nice_axis(lo: float, hi: float) -> tuple[float, float, list[float]]:
    """An axis covering [lo, hi] (lo < hi) whose ends and ticks fall on 1/2/5 x 10^k steps."""
    raw = (hi - lo) / TICK_COUNT
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return first * step, last * step, [k * step for k in range(first, last + 1)]


@dataclass(frozen=True)
class Frame:
    """Maps data coordinates onto the plot area."""

    x_lo: float
    x_hi: float
    y_lo: float
    y_hi: float

    def px(self, x: float) -> float:
        return MARGIN_LEFT + (x - self.x_lo) / (self.x_hi - self.x_lo) * (WIDTH - MARGIN_LEFT - MARGIN_RIGHT)

    def py(self, y: float) -> float:
        return MARGIN_TOP + PLOT_HEIGHT - (y - self.y_lo) / (self.y_hi - self.y_lo) * PLOT_HEIGHT


def svg_open(title: str, height: int) -> str:
    return (f'<svg class="chart" viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" height="{height}" role="img" '
            f'aria-label="{esc(title)}" font-family="sans-serif" font-size="11">'
            f'<text x="{WIDTH / 2}" y="18" text-anchor="middle" font-size="13" font-weight="bold">{esc(title)}</text>')


def no_data(title: str) -> str:
    height = MARGIN_TOP + PLOT_HEIGHT + MARGIN_BOTTOM
    return (svg_open(title, height) + f'<rect x="{MARGIN_LEFT}" y="{MARGIN_TOP}" '
            f'width="{WIDTH - MARGIN_LEFT - MARGIN_RIGHT}" height="{PLOT_HEIGHT}" fill="#f6f6f6" stroke="#ccc"/>'
            f'<text x="{WIDTH / 2}" y="{MARGIN_TOP + PLOT_HEIGHT / 2}" text-anchor="middle" fill="#777">'
            'no data</text></svg>')


def axes(frame: Frame, x_ticks: list[float], y_ticks: list[float], x_label: str, y_label: str) -> list[str]:
    """Grid lines, tick numbers and axis labels."""
    bottom, right = MARGIN_TOP + PLOT_HEIGHT, WIDTH - MARGIN_RIGHT
    parts = [f'<rect x="{MARGIN_LEFT}" y="{MARGIN_TOP}" width="{right - MARGIN_LEFT}" height="{PLOT_HEIGHT}" '
             'fill="#fbfbfb" stroke="#bbb"/>']
    for y in y_ticks:
        py = frame.py(y)
        parts.append(f'<line x1="{MARGIN_LEFT}" y1="{py:.1f}" x2="{right}" y2="{py:.1f}" stroke="#e4e4e4"/>'
                     f'<text x="{MARGIN_LEFT - 6}" y="{py + 4:.1f}" text-anchor="end">{esc(tick_label(y))}</text>')
    for x in x_ticks:
        px = frame.px(x)
        parts.append(f'<line x1="{px:.1f}" y1="{bottom}" x2="{px:.1f}" y2="{bottom + 4}" stroke="#888"/>'
                     f'<text x="{px:.1f}" y="{bottom + 16}" text-anchor="middle">{esc(tick_label(x))}</text>')
    parts.append(f'<text x="{(MARGIN_LEFT + right) / 2}" y="{bottom + 34}" text-anchor="middle">{esc(x_label)}</text>')
    middle = MARGIN_TOP + PLOT_HEIGHT / 2
    parts.append(f'<text x="14" y="{middle}" text-anchor="middle" transform="rotate(-90 14 {middle})">'
                 f'{esc(y_label)}</text>')
    return parts


def line_chart(series: dict[str, list[tuple[float, float]]], title: str, x_label: str, y_label: str,
               events: list[tuple[float, str, str]] = ()) -> str:
    """One line (with dot markers when short) per named series of (x, y) points, and a legend
    below the plot, one row per series. `events`: (x, kind, what) of run events (EVENT_COLOURS'
    kinds), each a dashed vertical line where x is on the axis, with a legend row per kind."""
    clean = {name: sorted((float(x), float(y)) for x, y in points if math.isfinite(x) and math.isfinite(y))
             for name, points in series.items()}
    clean = {name: points for name, points in clean.items() if points}
    if not clean:
        return no_data(title)
    x_lo, x_hi, x_ticks = nice_axis(*padded_range([x for points in clean.values() for x, _ in points]))
    y_lo, y_hi, y_ticks = nice_axis(*padded_range([y for points in clean.values() for _, y in points]))
    frame = Frame(x_lo, x_hi, y_lo, y_hi)
    shown = [(x, kind, what) for x, kind, what in events if kind in EVENT_COLOURS and x_lo <= x <= x_hi]
    kinds = [kind for kind in EVENT_COLOURS if any(k == kind for _, k, _ in shown)]
    legend_top = MARGIN_TOP + PLOT_HEIGHT + MARGIN_BOTTOM
    parts = [svg_open(title, legend_top + LEGEND_ROW * (len(clean) + len(kinds))),
             *axes(frame, x_ticks, y_ticks, x_label, y_label)]
    for x, kind, what in shown:
        parts.append(f'<line class="event" x1="{frame.px(x):.1f}" y1="{MARGIN_TOP}" x2="{frame.px(x):.1f}" '
                     f'y2="{MARGIN_TOP + PLOT_HEIGHT}" stroke="{EVENT_COLOURS[kind]}" stroke-width="1.5" '
                     f'stroke-dasharray="5 3"><title>{esc(what)}</title></line>')
    for i, (name, points) in enumerate(clean.items()):
        colour = PALETTE[i % len(PALETTE)]
        coords = " ".join(f"{frame.px(x):.1f},{frame.py(y):.1f}" for x, y in points)
        parts.append(f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="2"/>')
        if len(points) <= MAX_MARKED_POINTS:
            parts += [f'<circle cx="{frame.px(x):.1f}" cy="{frame.py(y):.1f}" r="3" fill="{colour}">'
                      f'<title>{esc(name)}: {esc(tick_label(x))}, {esc(tick_label(y))}</title></circle>'
                      for x, y in points]
        row = legend_top + LEGEND_ROW * i
        parts.append(f'<rect x="{MARGIN_LEFT}" y="{row + 2}" width="14" height="10" fill="{colour}"/>'
                     f'<text x="{MARGIN_LEFT + 20}" y="{row + 11}">{esc(name)}</text>')
    for i, kind in enumerate(kinds, len(clean)):
        row, steps = legend_top + LEGEND_ROW * i, ", ".join(tick_label(x) for x, k, _ in shown if k == kind)
        parts.append(f'<line x1="{MARGIN_LEFT}" y1="{row + 7}" x2="{MARGIN_LEFT + 14}" y2="{row + 7}" '
                     f'stroke="{EVENT_COLOURS[kind]}" stroke-width="1.5" stroke-dasharray="5 3"/>'
                     f'<text x="{MARGIN_LEFT + 20}" y="{row + 11}">{esc(kind)} at step {esc(steps)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def histogram(values: list[float], bins: int, title: str, x_label: str) -> str:
    """Counts of `values` in `bins` equal-width bins between their min and max."""
    if bins < 1:
        raise ValueError(f"histogram needs at least one bin, got {bins}")
    clean = [float(v) for v in values if math.isfinite(v)]
    if not clean:
        return no_data(title)
    lo, hi = padded_range(clean)
    width = (hi - lo) / bins
    counts = [0] * bins
    for v in clean:
        counts[min(int((v - lo) / width), bins - 1)] += 1  # the max lands in the last bin
    x_lo, x_hi, x_ticks = nice_axis(lo, hi)
    _, y_hi, y_ticks = nice_axis(0.0, max(counts))
    frame = Frame(x_lo, x_hi, 0.0, y_hi)
    parts = [svg_open(title, MARGIN_TOP + PLOT_HEIGHT + MARGIN_BOTTOM),
             *axes(frame, x_ticks, [t for t in y_ticks if t == int(t)], x_label, "count")]
    for i, count in enumerate(counts):
        left, right = lo + i * width, lo + (i + 1) * width
        x0, x1, top = frame.px(left), frame.px(right), frame.py(count)
        parts.append(f'<rect x="{x0:.1f}" y="{top:.1f}" width="{max(x1 - x0 - 1, 1):.1f}" '
                     f'height="{frame.py(0) - top:.1f}" fill="{PALETTE[0]}">'
                     f'<title>[{esc(tick_label(left))}, {esc(tick_label(right))}]: {count}</title></rect>')
    parts.append("</svg>")
    return "".join(parts)
