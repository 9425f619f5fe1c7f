"""SVG charts drawn on the server: line charts, a heatmap, a histogram and a timeline, each with scaled
axes and a legend. Pure functions from numbers to SVG text, no I/O. Every drawn element that stands
for data carries `data-tag` and `data-points`, and each chart's root `data-points` (the total), so a
test (or a curious user) can count what was drawn against what is stored.

Left out on purpose: interaction (zoom, hover), log scales and styling options; a tooltip is the
SVG `<title>` of each marker."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

WIDTH, HEIGHT = 560, 250
# Margins around the plot area: left holds y tick labels, bottom the x ticks and the axis label.
LEFT, RIGHT, TOP, BOTTOM = 58, 12, 10, 40
LEGEND_ROW = 16
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#17becf")
# Markers on every point while a series is short enough for them to stay readable.
MAX_MARKERS = 80


@dataclass(frozen=True)
class Series:
    """One line: `points` are (x, y) sorted by x; `tag` names the metric it was read from."""

    tag: str
    label: str
    points: Sequence[tuple[float, float]]


@dataclass(frozen=True)
class Span:
    """A bar on a timeline lane from `start` to `end` (seconds); start == end draws a tick."""

    start: float
    end: float
    label: str


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About `count` round tick values covering [lo, hi] (steps of 1, 2 or 5 times a power of ten)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"axis range [{lo}, {hi}] is not finite")
    lo, hi = min(lo, hi), max(lo, hi)
    if hi == lo:  # one value: an axis around it, not below zero for a value that is not
        pad = abs(lo) * 0.5 or 0.5
        lo, hi = (max(0.0, lo - pad) if lo >= 0 else lo - pad), hi + pad
    raw = (hi - lo) / max(1, count)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(lo / step) * step
    ticks, t = [], first
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 12))
        t += step
    if ticks[-1] < hi:
        ticks.append(round(t, 12))
    return ticks


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e4, "k")):
        if abs(v) >= scale:
            return f"{v / (1e3 if suffix == 'k' else scale):.4g}{suffix}"
    if abs(v) < 1e-3:
        return f"{v:.1e}"
    return f"{v:.4g}"


class _Frame:
    """Maps data coordinates onto a plot area and draws its axes (`y_ticks` empty: lanes, not a scale)."""

    def __init__(
        self,
        x_range: tuple[float, float],
        x_ticks: list[float],
        y_range: tuple[float, float],
        y_ticks: list[float],
        legend_rows: int,
    ) -> None:
        (self.x0, self.x1), (self.y0, self.y1) = x_range, y_range
        if self.x1 == self.x0:
            self.x0, self.x1 = self.x0 - 1, self.x1 + 1
        self.x_ticks, self.y_ticks = x_ticks, y_ticks
        self.height = HEIGHT + legend_rows * LEGEND_ROW
        self.plot_w, self.plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    @classmethod
    def fit(cls, xs: Sequence[float], ys: Sequence[float], legend_rows: int, integer_x: bool) -> _Frame:
        """Axes from round ticks around the data (integer x ticks for steps and versions)."""
        x_ticks = nice_ticks(min(xs), max(xs), 6)
        if integer_x:
            x_ticks = sorted({round(t) for t in x_ticks})
        y_ticks = nice_ticks(min(ys), max(ys), 5)
        return cls((x_ticks[0], x_ticks[-1]), x_ticks, (y_ticks[0], y_ticks[-1]), y_ticks, legend_rows)

    def x(self, v: float) -> float:
        return LEFT + (v - self.x0) / (self.x1 - self.x0) * self.plot_w

    def y(self, v: float) -> float:
        return TOP + self.plot_h - (v - self.y0) / (self.y1 - self.y0) * self.plot_h

    def axes(self, x_label: str, y_label: str) -> list[str]:
        out = [f'<rect x="{LEFT}" y="{TOP}" width="{self.plot_w}" height="{self.plot_h}" class="plot"/>']
        bottom = TOP + self.plot_h
        for t in self.x_ticks:
            x = self.x(t)
            out.append(f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{bottom}" class="grid"/>')
            out.append(f'<text x="{x:.1f}" y="{bottom + 14}" class="tick" text-anchor="middle">{_fmt(t)}</text>')
        for t in self.y_ticks:
            y = self.y(t)
            out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + self.plot_w}" y2="{y:.1f}" class="grid"/>')
            out.append(f'<text x="{LEFT - 5}" y="{y + 4:.1f}" class="tick" text-anchor="end">{_fmt(t)}</text>')
        out.append(
            f'<text x="{LEFT + self.plot_w / 2:.1f}" y="{bottom + 32}" class="axis" text-anchor="middle">'
            f"{escape(x_label)}</text>"
        )
        out.append(
            f'<text transform="translate(13 {TOP + self.plot_h / 2:.1f}) rotate(-90)" class="axis" '
            f'text-anchor="middle">{escape(y_label)}</text>'
        )
        return out


def _cell_ticks(first: int | float, last: int | float) -> list[float]:
    """Integer ticks between the first and last cell (cells are one unit wide, centred on their value)."""
    return [t for t in nice_ticks(first, last, 6) if float(t).is_integer() and first <= t <= last]


def _svg(body: list[str], height: int, points: int, kind: str) -> str:
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" data-kind="{kind}" data-points="{points}" '
        f'width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}">' + "".join(body) + "</svg>"
    )


def empty_chart(message: str) -> str:
    """A chart area that says why it has nothing to draw (which tags it waits for)."""
    return _svg(
        [f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" class="empty" text-anchor="middle">{escape(message)}</text>'],
        HEIGHT,
        0,
        "empty",
    )


def _legend(entries: Sequence[tuple[str, str]], top: float) -> list[str]:
    out = []
    for i, (label, color) in enumerate(entries):
        y = top + i * LEGEND_ROW
        out.append(f'<rect x="{LEFT}" y="{y:.1f}" width="12" height="4" fill="{color}"/>')
        out.append(f'<text x="{LEFT + 18}" y="{y + 5:.1f}" class="legend">{escape(label)}</text>')
    return out


def line_chart(series: Sequence[Series], x_label: str, y_label: str, empty: str) -> str:
    """Lines (and markers while short) of every series on shared axes; `empty` is shown with no points."""
    drawn = [s for s in series if s.points]
    if not drawn:
        return empty_chart(empty)
    xs = [x for s in drawn for x, _ in s.points]
    ys = [y for s in drawn for _, y in s.points]
    frame = _Frame.fit(xs, ys, len(drawn), integer_x=all(float(x).is_integer() for x in xs))
    body = frame.axes(x_label, y_label)
    legend = []
    for i, s in enumerate(drawn):
        color = PALETTE[i % len(PALETTE)]
        coords = " ".join(f"{frame.x(x):.1f},{frame.y(y):.1f}" for x, y in s.points)
        body.append(
            f'<g class="series" data-tag="{escape(s.tag)}" data-points="{len(s.points)}">'
            f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="1.6"/>'
        )
        if len(s.points) <= MAX_MARKERS:
            for x, y in s.points:
                body.append(
                    f'<circle cx="{frame.x(x):.1f}" cy="{frame.y(y):.1f}" r="2.2" fill="{color}">'
                    f"<title>{escape(s.label)}: {_fmt(x)}, {_fmt(y)}</title></circle>"
                )
        body.append("</g>")
        legend.append((s.label, color))
    body += _legend(legend, HEIGHT - 4)
    return _svg(body, frame.height, len(xs), "line")


def _heat_color(f: float) -> str:
    """White to dark blue for f in [0, 1]."""
    f = min(1.0, max(0.0, f))
    r, g, b = (round(255 + (a - 255) * f) for a in (8, 48, 107))
    return f"rgb({r},{g},{b})"


def heatmap(rows: Sequence[Series], x_label: str, row_label: str, value_label: str, empty: str) -> str:
    """One row per series (e.g. a MoE layer), one cell per point, coloured by value between the
    smallest and largest value; the legend is the colour bar."""
    drawn = [s for s in rows if s.points]
    if not drawn:
        return empty_chart(empty)
    xs = sorted({x for s in drawn for x, _ in s.points})
    values = [y for s in drawn for _, y in s.points]
    lo, hi = min(values), max(values)
    frame = _Frame((xs[0] - 0.5, xs[-1] + 0.5), _cell_ticks(xs[0], xs[-1]), (0, len(drawn)), [], 1)
    body = frame.axes(x_label, row_label)
    cell_w = frame.plot_w / (frame.x1 - frame.x0)
    cell_h = frame.plot_h / len(drawn)
    for i, s in enumerate(drawn):
        top = frame.y(i + 1)
        body.append(
            f'<text x="{LEFT - 5}" y="{top + cell_h / 2 + 4:.1f}" class="tick" text-anchor="end">{escape(s.label)}</text>'
        )
        body.append(f'<g class="series" data-tag="{escape(s.tag)}" data-points="{len(s.points)}">')
        for x, v in s.points:
            f = 0.5 if hi == lo else (v - lo) / (hi - lo)
            body.append(
                f'<rect x="{frame.x(x - 0.5):.1f}" y="{top:.1f}" width="{cell_w + 0.3:.1f}" height="{cell_h:.1f}" '
                f'fill="{_heat_color(f)}"><title>{escape(s.label)} step {_fmt(x)}: {_fmt(v)}</title></rect>'
            )
        body.append("</g>")
    bar_y = HEIGHT - 2
    for k in range(40):
        body.append(f'<rect x="{LEFT + k * 4}" y="{bar_y}" width="4" height="8" fill="{_heat_color(k / 39)}"/>')
    body.append(
        f'<text x="{LEFT + 166}" y="{bar_y + 8}" class="legend">{escape(value_label)}: {_fmt(lo)} .. {_fmt(hi)}</text>'
    )
    return _svg(body, frame.height, len(values), "heatmap")


def histogram(tag: str, counts: dict[int, int], x_label: str, y_label: str, empty: str) -> str:
    """One bar per integer bin."""
    if not counts:
        return empty_chart(empty)
    bins = sorted(counts)
    y_ticks = nice_ticks(0, max(counts.values()), 5)
    frame = _Frame((bins[0] - 0.5, bins[-1] + 0.5), _cell_ticks(bins[0], bins[-1]), (0, y_ticks[-1]), y_ticks, 1)
    body = frame.axes(x_label, y_label)
    body.append(f'<g class="series" data-tag="{escape(tag)}" data-points="{len(bins)}">')
    width = frame.plot_w / (frame.x1 - frame.x0) * 0.8
    for b in bins:
        x, y = frame.x(b) - width / 2, frame.y(counts[b])
        body.append(
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{width:.1f}" height="{frame.y(frame.y0) - y:.1f}" '
            f'fill="{PALETTE[0]}"><title>{b}: {counts[b]}</title></rect>'
        )
    body.append("</g>")
    body += _legend([(y_label, PALETTE[0])], HEIGHT - 4)
    return _svg(body, frame.height, len(bins), "histogram")


def timeline(lanes: Sequence[tuple[str, str, str, Sequence[Span]]], x_label: str, empty: str) -> str:
    """One lane per (tag, lane name, legend label, spans): bars from start to end, ticks for instants."""
    drawn = [lane for lane in lanes if lane[3]]
    if not drawn:
        return empty_chart(empty)
    starts = [s.start for *_, spans in drawn for s in spans]
    ends = [s.end for *_, spans in drawn for s in spans]
    x_ticks = nice_ticks(min(starts), max(ends), 6)
    frame = _Frame((x_ticks[0], x_ticks[-1]), x_ticks, (0, len(drawn)), [], len(drawn))
    body = frame.axes(x_label, "")
    lane_h = frame.plot_h / len(drawn)
    legend = []
    for i, (tag, name, label, spans) in enumerate(drawn):
        color = PALETTE[i % len(PALETTE)]
        top = frame.y(i + 1) + lane_h * 0.2
        body.append(
            f'<text x="{LEFT - 5}" y="{top + lane_h * 0.3 + 4:.1f}" class="tick" text-anchor="end">'
            f"{escape(name[:10])}</text>"
        )
        body.append(f'<g class="series" data-tag="{escape(tag)}" data-points="{len(spans)}">')
        for s in spans:
            x = frame.x(s.start)
            w = max(1.5, frame.x(s.end) - x)
            body.append(
                f'<rect x="{x:.1f}" y="{top:.1f}" width="{w:.1f}" height="{lane_h * 0.6:.1f}" fill="{color}" '
                f'opacity="0.8"><title>{escape(s.label)}</title></rect>'
            )
        body.append("</g>")
        legend.append((label, color))
    body += _legend(legend, HEIGHT - 4)
    return _svg(body, frame.height, sum(len(spans) for *_, spans in drawn), "timeline")
