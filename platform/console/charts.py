"""Server-side drawing for the console: an inline SVG stacked bar chart and human-readable byte figures.

Pure functions (data in, text out, no database). The chart uses SVG presentation attributes only (fill=, x=, ...):
the console's Content-Security-Policy forbids style attributes and scripts. Every text that enters the markup is
escaped; the bars' colours are the legend's (.swatch.device/.dram/.ssd/.network in console.css), so a bar and its legend
entry always match; each bar carries a <title> with its exact figure, and the <svg> a role="img" and an aria-label
summarising the whole series for screen readers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import date, timedelta
from decimal import ROUND_CEILING, Decimal

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

TIERS: tuple[str, ...] = ("device", "dram", "ssd", "network")  # network: the fleet's shared store
TIER_COLOURS: dict[str, str] = {  # = console.css swatches
    "device": "#0b5cad",
    "dram": "#d97706",
    "ssd": "#6b7280",
    "network": "#0f766e",
}
AXIS_COLOUR, GRID_COLOUR, TEXT_COLOUR = "#4f5761", "#d0d7de", "#4f5761"

WIDTH, HEIGHT = 720, 280
LEFT, RIGHT, TOP, BOTTOM = 72, 12, 12, 40
PLOT_WIDTH, PLOT_HEIGHT = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
BAR_FILL_RATIO = 0.7  # of each day's slot; the rest is the gap between bars
MAX_X_LABELS = 8
Y_TICKS = 4


@dataclass(frozen=True, slots=True)
class Bar:
    """One stacked bar: `label` names it in full (titles, the summary), `tick` on the x axis; `values` per tier."""

    label: str
    tick: str
    values: Mapping[str, Decimal] = field(default_factory=dict)

    @property
    def total(self) -> Decimal:
        return sum((Decimal(v) for v in self.values.values()), Decimal(0))


def decimal_text(value: Decimal) -> str:
    """Positional, without trailing zeros or an exponent: 3.5, 10, 0.0000016."""
    value = Decimal(value)
    if value == 0:
        return "0"
    return format(value.normalize(), "f")


def daily_bars(points: Iterable[tuple[date, Mapping[str, Decimal]]], *, first_day: date, days: int) -> list[Bar]:
    """One bar per day from `first_day` for `days` days, days without a point at zero (points outside are dropped);
    several points on one day add up."""
    by_day: dict[date, dict[str, Decimal]] = {}
    for day, values in points:
        totals = by_day.setdefault(day, dict.fromkeys(TIERS, Decimal(0)))
        for tier in TIERS:
            totals[tier] += Decimal(values.get(tier, 0))
    bars = []
    for offset in range(days):
        day = first_day + timedelta(days=offset)
        values = by_day.get(day, dict.fromkeys(TIERS, Decimal(0)))
        bars.append(Bar(label=day.isoformat(), tick=day.strftime("%m-%d"), values=values))
    return bars


def nice_axis_top(largest: Decimal, ticks: int = Y_TICKS) -> tuple[Decimal, Decimal]:
    """(top, step): a step of 1, 2 or 5 x 10^k and the smallest multiple of it at or above `largest` (> 0)."""
    assert largest > 0
    raw = Decimal(largest) / ticks
    magnitude = Decimal(1).scaleb(raw.adjusted())
    step = next(f * magnitude for f in (1, 2, 5, 10) if f * magnitude >= raw)
    top = step * (Decimal(largest) / step).to_integral_value(rounding=ROUND_CEILING)
    return top, step


def _num(value: float) -> str:
    return f"{value:.2f}".rstrip("0").rstrip(".") or "0"


def _y_axis(top: Decimal, step: Decimal, unit: str) -> list[str]:
    parts = []
    ticks = int(top / step)
    for index in range(ticks + 1):
        value = step * index
        y = TOP + PLOT_HEIGHT - float(value / top) * PLOT_HEIGHT
        parts.append(
            f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{_num(y)}" y2="{_num(y)}" stroke="{GRID_COLOUR}" '
            f'stroke-width="1"/>'
        )
        parts.append(
            f'<text x="{LEFT - 6}" y="{_num(y + 4)}" text-anchor="end" font-size="11" fill="{TEXT_COLOUR}">'
            f"{escape(decimal_text(value))}</text>"
        )
    middle = f"{TOP + PLOT_HEIGHT / 2:.0f}"
    parts.append(
        f'<text x="14" y="{middle}" text-anchor="middle" font-size="11" fill="{TEXT_COLOUR}" '
        f'transform="rotate(-90 14 {middle})">{escape(unit)}</text>'
    )
    return parts


def _bars(bars: Sequence[Bar], top: Decimal, unit: str) -> list[str]:
    parts = []
    slot = PLOT_WIDTH / len(bars)
    bar_width = max(slot * BAR_FILL_RATIO, 1.0)
    label_every = math.ceil(len(bars) / MAX_X_LABELS)
    baseline = TOP + PLOT_HEIGHT
    for index, bar in enumerate(bars):
        x = LEFT + index * slot + (slot - bar_width) / 2
        stacked = 0.0
        for tier in TIERS:
            value = Decimal(bar.values.get(tier, 0))
            if value <= 0:
                continue
            height = float(value / top) * PLOT_HEIGHT
            stacked += height
            title = f"{bar.label} {tier}: {decimal_text(value)} {unit}"
            parts.append(
                f'<rect x="{_num(x)}" y="{_num(baseline - stacked)}" width="{_num(bar_width)}" '
                f'height="{_num(height)}" fill="{TIER_COLOURS[tier]}" data-tier="{tier}">'
                f"<title>{escape(title)}</title></rect>"
            )
        if index % label_every == 0:
            centre = x + bar_width / 2
            parts.append(
                f'<text x="{_num(centre)}" y="{baseline + 16}" text-anchor="middle" font-size="11" '
                f'fill="{TEXT_COLOUR}">{escape(bar.tick)}</text>'
            )
    return parts


def chart_summary(bars: Sequence[Bar], *, title: str, unit: str) -> str:
    """The chart in one sentence (its aria-label): range, total, the peak bar and the total per tier."""
    total = sum((bar.total for bar in bars), Decimal(0))
    peak = max(bars, key=lambda bar: bar.total)
    per_tier = ", ".join(
        f"{tier} {decimal_text(sum((Decimal(b.values.get(tier, 0)) for b in bars), Decimal(0)))}" for tier in TIERS
    )
    return (
        f"{title}: {len(bars)} bars from {bars[0].label} to {bars[-1].label}; total {decimal_text(total)} {unit} "
        f"({per_tier}); highest {peak.label} with {decimal_text(peak.total)} {unit}."
    )


def stacked_bar_chart(bars: Sequence[Bar], *, title: str, unit: str) -> SafeString:
    """An <svg> with one bar per entry of `bars`, its tiers stacked bottom-up in TIERS order, each segment's height
    proportional to its value (the y axis runs from 0 to a round top at or above the tallest bar). Empty markup
    ("") when there are no bars or every value is zero: the page then shows its empty state instead."""
    largest = max((bar.total for bar in bars), default=Decimal(0))
    if largest <= 0:
        return mark_safe("")
    top, step = nice_axis_top(largest)
    summary = chart_summary(bars, title=title, unit=unit)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="{escape(summary)}" focusable="false">'
    ]
    parts += _y_axis(top, step, unit)
    parts += _bars(bars, top, unit)
    baseline = TOP + PLOT_HEIGHT
    parts.append(
        f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{baseline}" y2="{baseline}" stroke="{AXIS_COLOUR}" '
        f'stroke-width="1"/>'
    )
    parts.append(f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{baseline}" stroke="{AXIS_COLOUR}" stroke-width="1"/>')
    parts.append("</svg>")
    return mark_safe("".join(parts))


LINE_COLOUR = "#0b5cad"


@dataclass(frozen=True, slots=True)
class LinePoint:
    """One point of a line chart: `label` in full (its title), `tick` on the x axis, `value` (None: no data)."""

    label: str
    tick: str
    value: float | None


def line_chart(points: Sequence[LinePoint], *, title: str, unit: str, top: Decimal) -> SafeString:
    """An <svg> line over the points that have a value (a gap where one has none), each drawn as a circle with a
    <title>, the y axis from 0 to `top`. Empty markup ("") when no point has a value."""
    if not any(point.value is not None for point in points):
        return mark_safe("")
    valued = [p for p in points if p.value is not None]
    summary = (
        f"{title}: {len(valued)} of {len(points)} points with data, from {points[0].label} to {points[-1].label}; "
        f"lowest {min(p.value for p in valued if p.value is not None):.1f} {unit}, "
        f"highest {max(p.value for p in valued if p.value is not None):.1f} {unit}."
    )
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="{escape(summary)}" focusable="false">'
    ]
    parts += _y_axis(top, top / Y_TICKS, unit)
    parts += _line(points, float(top), unit)
    baseline = TOP + PLOT_HEIGHT
    parts.append(
        f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{baseline}" y2="{baseline}" stroke="{AXIS_COLOUR}" '
        f'stroke-width="1"/>'
    )
    parts.append("</svg>")
    return mark_safe("".join(parts))


def _line(points: Sequence[LinePoint], top: float, unit: str) -> list[str]:
    slot = PLOT_WIDTH / len(points)
    label_every = math.ceil(len(points) / MAX_X_LABELS)
    baseline = TOP + PLOT_HEIGHT
    parts, run = [], []
    for index, point in enumerate(points):
        x = LEFT + index * slot + slot / 2
        if index % label_every == 0:
            parts.append(
                f'<text x="{_num(x)}" y="{baseline + 16}" text-anchor="middle" font-size="11" '
                f'fill="{TEXT_COLOUR}">{escape(point.tick)}</text>'
            )
        if point.value is None:
            parts += _polyline(run)
            run = []
            continue
        y = baseline - min(point.value / top, 1.0) * PLOT_HEIGHT
        run.append(f"{_num(x)},{_num(y)}")
        title = f"{point.label}: {point.value:.1f} {unit}"
        parts.append(
            f'<circle cx="{_num(x)}" cy="{_num(y)}" r="3" fill="{LINE_COLOUR}" data-point="{index}">'
            f"<title>{escape(title)}</title></circle>"
        )
    return parts + _polyline(run)


def _polyline(run: list[str]) -> list[str]:
    if len(run) < 2:
        return []
    return [f'<polyline points="{" ".join(run)}" fill="none" stroke="{LINE_COLOUR}" stroke-width="2"/>']
