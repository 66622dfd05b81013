"""console.charts: the stacked bar chart's geometry (heights proportional to values, stacked bottom-up), its
accessibility (role, label, titles), escaping, the empty case; day filling; human byte figures."""

from __future__ import annotations

import re
from datetime import date
from decimal import Decimal

import pytest

from console import charts
from console.charts import Bar, daily_bars, nice_axis_top, stacked_bar_chart
from kcaas.units import human_bytes

RECT = re.compile(
    r'<rect x="([\d.]+)" y="([\d.]+)" width="([\d.]+)" height="([\d.]+)" fill="(#[0-9a-f]{6})" '
    r'data-tier="(\w+)"><title>([^<]*)</title></rect>'
)


def _rects(svg: str) -> list[tuple[float, float, float, float, str, str, str]]:
    return [
        (float(x), float(y), float(w), float(h), fill, tier, title)
        for x, y, w, h, fill, tier, title in RECT.findall(svg)
    ]


def test_bar_heights_are_proportional_and_stacked_bottom_up():
    bars = [
        Bar("2026-03-01", "03-01", {"device": Decimal(10), "dram": Decimal(5), "ssd": Decimal(0)}),
        Bar("2026-03-02", "03-02", {"device": Decimal(20), "dram": Decimal(0), "ssd": Decimal("2.5")}),
    ]
    svg = str(stacked_bar_chart(bars, title="GB-hours per day", unit="GB-hours"))
    rects = _rects(svg)
    assert [(tier, title) for *_, tier, title in rects] == [
        ("device", "2026-03-01 device: 10 GB-hours"),
        ("dram", "2026-03-01 dram: 5 GB-hours"),
        ("device", "2026-03-02 device: 20 GB-hours"),
        ("ssd", "2026-03-02 ssd: 2.5 GB-hours"),
    ]  # a zero value draws nothing
    assert nice_axis_top(Decimal("22.5")) == (30, 10)  # the tallest bar is 22.5: the axis runs 0..30
    heights = {(title.split()[0], tier): h for _, _, _, h, _, tier, title in rects}
    unit = charts.PLOT_HEIGHT / 30
    assert heights[("2026-03-01", "device")] == pytest.approx(10 * unit, abs=0.01)
    assert heights[("2026-03-01", "dram")] == pytest.approx(5 * unit, abs=0.01)
    assert heights[("2026-03-02", "device")] == pytest.approx(2 * heights[("2026-03-01", "device")], abs=0.02)
    baseline = charts.TOP + charts.PLOT_HEIGHT
    device, dram = rects[0], rects[1]
    assert device[1] + device[3] == pytest.approx(baseline, abs=0.01)  # device sits on the axis
    assert dram[1] + dram[3] == pytest.approx(device[1], abs=0.01)  # dram on top of device
    assert device[0] == dram[0] and rects[2][0] > device[0]  # one column per bar, left to right
    assert {fill for _, _, _, _, fill, _, _ in rects} == {"#0b5cad", "#d97706", "#6b7280"}
    assert all(charts.TIER_COLOURS[tier] == fill for _, _, _, _, fill, tier, _ in rects)


def test_axes_ticks_and_accessible_summary():
    bars = [Bar("2026-03-01", "03-01", {"device": Decimal(7)}), Bar("2026-03-02", "03-02", {"dram": Decimal(1)})]
    svg = str(stacked_bar_chart(bars, title="Usage", unit="GB-hours"))
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    assert 'role="img"' in svg and "style=" not in svg and "<script" not in svg
    label = re.search(r'aria-label="([^"]*)"', svg).group(1)
    assert label == (
        "Usage: 2 bars from 2026-03-01 to 2026-03-02; total 8 GB-hours (device 7, dram 1, ssd 0, network 0); "
        "highest 2026-03-01 with 7 GB-hours."
    )
    ticks = re.findall(r'text-anchor="end" font-size="11" fill="#4f5761">([^<]*)</text>', svg)
    assert ticks == ["0", "2", "4", "6", "8"]  # a round step; the top at or above the tallest bar
    assert ">03-01</text>" in svg and ">03-02</text>" in svg and ">GB-hours</text>" in svg


def test_labels_and_titles_are_escaped():
    bars = [Bar('<script>alert(1)</script>"', "<b>", {"device": Decimal(1)})]
    svg = str(stacked_bar_chart(bars, title='x" onload="evil', unit="<u>"))
    assert "<script>" not in svg and "<b>" not in svg and "<u>" not in svg
    assert 'onload="evil' not in svg
    assert "&lt;script&gt;alert(1)&lt;/script&gt;&quot;" in svg and "&lt;b&gt;" in svg


@pytest.mark.parametrize("bars", [[], [Bar("d", "d", {"device": Decimal(0)})]])
def test_no_bars_or_all_zero_draws_nothing(bars):
    assert stacked_bar_chart(bars, title="t", unit="u") == ""


def test_many_bars_label_at_most_eight_ticks():
    bars = daily_bars([(date(2026, 3, 5), {"device": Decimal(3)})], first_day=date(2026, 3, 1), days=30)
    svg = str(stacked_bar_chart(bars, title="t", unit="u"))
    assert len(re.findall(r'text-anchor="middle" font-size="11" fill="#4f5761">\d\d-\d\d<', svg)) <= charts.MAX_X_LABELS
    assert len(_rects(svg)) == 1


def test_daily_bars_fill_missing_days_and_add_points_of_one_day():
    points = [
        (date(2026, 3, 2), {"device": Decimal("1.5")}),
        (date(2026, 3, 2), {"device": Decimal(1), "ssd": 2}),
        (date(2026, 4, 9), {"device": Decimal(99)}),
    ]  # the last is outside and dropped
    bars = daily_bars(points, first_day=date(2026, 3, 1), days=3)
    assert [bar.label for bar in bars] == ["2026-03-01", "2026-03-02", "2026-03-03"]
    assert [bar.tick for bar in bars] == ["03-01", "03-02", "03-03"]
    assert bars[1].values == {"device": Decimal("2.5"), "dram": 0, "ssd": 2, "network": 0} and bars[1].total == Decimal(
        "4.5"
    )
    assert bars[0].total == 0 and bars[2].total == 0


@pytest.mark.parametrize(
    "largest,top,step",
    [
        (Decimal(1), 1, Decimal("0.5")),
        (Decimal(7), 8, 2),
        (Decimal("0.003"), Decimal("0.003"), Decimal("0.001")),
        (Decimal(101), 150, 50),
    ],
)
def test_nice_axis_top(largest, top, step):
    got_top, got_step = nice_axis_top(largest)
    assert got_top >= largest and got_top % got_step == 0
    assert (got_top, got_step) == (top, step)


@pytest.mark.parametrize(
    "count,text",
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (3435973837, "3.2 GiB"),
        (16 * 2**30, "16 GiB"),
        (2**50, "1 PiB"),
        (2**30 - 1, "1 GiB"),
        (2**62, "4096 PiB"),
    ],
)
def test_human_bytes(count, text):
    assert human_bytes(count) == text
