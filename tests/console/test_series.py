"""The console's time-series charts (console.series) on the overview, a tenant's page and a node's page, from
history stored through the real ingestion paths (tests/console/series_fixtures.py)."""

from __future__ import annotations

import re
from decimal import Decimal

import pytest

from console.charts import LinePoint, line_chart
from tests.console.series_fixtures import seed_history

pytestmark = pytest.mark.django_db

CIRCLE_TITLE = re.compile(r"<circle [^>]*><title>([^<]+)</title>")


def _chart(html: str, name: str) -> str:
    match = re.search(rf'data-chart="{name}"><svg.*?</svg>', html, re.S)
    assert match, f"no {name} chart"
    return match.group(0)


def _hit_rates(svg: str) -> list[str]:
    return [title.split(": ")[1] for title in CIRCLE_TITLE.findall(svg)]


@pytest.mark.parametrize("where", ["overview", "tenant", "node"])
def test_each_scope_draws_resident_hit_rate_and_gb_hours_from_stored_samples(readonly_client, where):
    history = seed_history()
    path = {
        "overview": "/console/",
        "tenant": f"/console/tenants/{history.tenant.pk}/",
        "node": f"/console/nodes/{history.node.pk}/",
    }[where]
    page = readonly_client.get(path)
    assert page.status_code == 200
    html = page.content.decode()
    assert _hit_rates(_chart(html, "hit-rate")) == ["10.0 %", "40.0 %", "75.0 %", "80.0 %"]
    resident = _chart(html, "resident")
    device = re.findall(r'data-tier="device"><title>[^<]* device: ([\d.]+) GiB</title>', resident)
    assert device == ["1", "0.75", "0.5", "0.25"]  # the heartbeats' device bytes, oldest first
    assert len(re.findall(r'data-tier="dram"', resident)) == 4 and 'data-tier="ssd"' not in resident
    if where == "tenant":
        assert 'data-chart="gb-hours"' not in html  # the ledger chart has its own section there
        assert "GB-hours per tier per day" in html
    else:
        assert re.search(r'data-tier="device"><title>', _chart(html, "gb-hours"))


def test_a_tenant_sees_only_its_own_caches_history(readonly_client):
    seed_history(name="one")
    other = seed_history(name="two").tenant
    html = readonly_client.get("/console/").content.decode()
    assert _hit_rates(_chart(html, "hit-rate")) == ["10.0 %", "40.0 %", "75.0 %", "80.0 %"]  # fleet: sums agree
    resident = _chart(html, "resident")
    assert re.findall(r'data-tier="device"><title>[^<]* device: ([\d.]+) GiB', resident) == ["2", "1.5", "1", "0.5"]
    html = readonly_client.get(f"/console/tenants/{other.pk}/").content.decode()
    resident = _chart(html, "resident")
    assert re.findall(r'data-tier="device"><title>[^<]* device: ([\d.]+) GiB', resident) == ["1", "0.75", "0.5", "0.25"]


def test_empty_history_shows_the_empty_states(readonly_client):
    html = readonly_client.get("/console/").content.decode()
    assert "No resident bytes reported in the last 24 hours." in html
    assert "No hit or miss counters reported in the last 24 hours." in html
    assert "No GB-hours in the last 30 days." in html


def test_line_chart_places_points_by_value_and_leaves_gaps():
    points = [LinePoint("a", "a", 0.0), LinePoint("b", "b", None), LinePoint("c", "c", 50.0), LinePoint("d", "d", 100)]
    svg = str(line_chart(points, title="t", unit="%", top=Decimal(100)))
    circles = re.findall(r'<circle cx="([\d.]+)" cy="([\d.]+)"', svg)
    assert [float(cy) for _, cy in circles] == [240.0, 126.0, 12.0]  # baseline 240, top 12: 0, 50, 100 %
    assert svg.count("<polyline") == 1  # a, then the gap at b, then c-d joined
    assert line_chart([LinePoint("a", "a", None)], title="t", unit="%", top=Decimal(1)) == ""


def _y_ticks(svg: str) -> list[str]:
    return re.findall(r'text-anchor="end" font-size="11" fill="#4f5761">([^<]*)</text>', svg)


@pytest.mark.parametrize(
    "scale,unit,ticks",
    [
        (2**20, "MiB", ["0", "0.5", "1", "1.5", "2"]),  # 1.25 to 2 MiB stacked: not 0.0005 GiB steps
        (300 * 2**10, "KiB", ["0", "200", "400", "600"]),  # 375 to 600 KiB
        (400, "B", ["0", "200", "400", "600", "800"]),  # 500 to 800 bytes
        (2**30, "GiB", ["0", "0.5", "1", "1.5", "2"]),
    ],
)
def test_the_resident_axis_picks_its_unit_by_magnitude_with_round_steps(readonly_client, scale, unit, ticks):
    seed_history(resident_scale=scale)
    html = readonly_client.get("/console/").content.decode()
    resident = _chart(html, "resident")
    assert _y_ticks(resident) == ticks
    assert f">{unit}</text>" in resident and f"Resident {unit} per tier per hour (UTC)" in html
