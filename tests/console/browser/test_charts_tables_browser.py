"""In Debian's chromium: the time-series charts drawn from history stored through the real ingestion paths, bars of
one width per table, the audit table inside 1280 px, the audit filter by action name, the wait a wrong TOTP code
imposes stated on the page, and the 404 page inside the navigation."""

from __future__ import annotations

import re

import pytest

from console import roles
from tenants import services as tenant_services
from tests.console.browser.conftest import LAPTOP, PASSWORD
from tests.console.conftest import make_console_user, totp_code
from tests.console.nodes_fixtures import GIB, make_node, make_tenant
from tests.console.series_fixtures import seed_history

pytestmark = pytest.mark.django_db(transaction=True)

HIT_RATES = ["10.0 %", "40.0 %", "75.0 %", "80.0 %"]  # series_fixtures' counters, hour by hour


def _point_titles(page, chart: str) -> list[str]:
    return page.locator(f'[data-chart="{chart}"] svg circle title').all_text_contents()


def _drawn(page, chart: str) -> dict:
    """The chart's box as chromium laid it out and its drawn marks."""
    svg = page.locator(f'[data-chart="{chart}"] svg')
    box = svg.bounding_box()
    return {"width": box["width"], "height": box["height"], "rects": svg.locator("rect").count()}


@pytest.mark.parametrize("where", ["overview", "tenant", "node"])
def test_charts_render_points_from_stored_samples(signed_in, where):
    page, _ = signed_in(roles.READ_ONLY)
    history = seed_history()
    path = {
        "overview": "/console/",
        "tenant": f"/console/tenants/{history.tenant.pk}/",
        "node": f"/console/nodes/{history.node.pk}/",
    }[where]
    page.goto(page.base + path)
    titles = _point_titles(page, "hit-rate")
    assert [t.split(": ")[1] for t in titles] == HIT_RATES
    resident = _drawn(page, "resident")
    assert resident["width"] > 600 and resident["height"] > 200 and resident["rects"] == 8  # 4 hours x device, DRAM
    device = page.locator('[data-chart="resident"] rect[data-tier="device"] title').all_text_contents()
    assert [t.rsplit(": ", 1)[1] for t in device] == ["1 GiB", "0.75 GiB", "0.5 GiB", "0.25 GiB"]
    if where != "tenant":
        assert _drawn(page, "gb-hours")["rects"] >= 1
    assert not page.js_errors


def _widths(page, selector: str) -> list[float]:
    return [round(box["width"], 1) for box in (m.bounding_box() for m in page.locator(selector).all()) if box]


def test_bars_of_one_table_have_one_width_and_empty_tiers_are_not_bars(signed_in):
    page, _ = signed_in(roles.READ_ONLY)
    tenant = make_tenant("bars-tenant")
    limits = {"max_device_bytes": 1024 * GIB, "max_dram_bytes": 3 * GIB, "max_ssd_bytes": 0, "max_network_bytes": 0}
    tenant_services.quota_update(tenant=tenant, **limits)
    make_node("bars-a", device=80 * GIB, dram=512 * GIB, ssd=0)
    make_node("bars-b-with-a-longer-name", device=8 * GIB, dram=0, ssd=4096 * GIB)
    page.goto(page.base + f"/console/tenants/{tenant.pk}/")
    widths = _widths(page, "#tenant-usage meter")
    assert len(widths) == 4 and len(set(widths)) == 1, widths  # device, DRAM, caches, tokens; SSD, network: no limit
    assert "none allowed" in page.locator("#tenant-usage").inner_text()
    page.goto(page.base + "/console/nodes/")
    widths = _widths(page, "#nodes-table meter")
    assert len(widths) == 4 and len(set(widths)) == 1, widths  # 2 device + 1 DRAM + 1 SSD; two tiers empty
    assert page.locator("#nodes-table .no-tier").all_text_contents() == ["no ssd", "no dram"]


def test_the_audit_table_fits_1280_px_and_filters_by_action_name(signed_in):
    page, _ = signed_in(roles.READ_ONLY)
    for n in range(3):
        tenant = make_tenant(f"audit-{'x' * 60}-{n}")
        tenant_services.quota_update(tenant=tenant, max_device_bytes=(n + 1) * GIB)
    page.set_viewport_size(LAPTOP)
    page.goto(page.base + "/console/audit/")
    sizes = page.evaluate(
        """() => { const w = document.querySelector('table.audit').closest('.table-wrap');
        return {scrolled: w.scrollWidth, shown: w.clientWidth, page: document.documentElement.scrollWidth,
                window: window.innerWidth}; }"""
    )
    assert sizes["scrolled"] <= sizes["shown"] and sizes["page"] <= sizes["window"], sizes  # no sideways scroll
    page.get_by_label("Action").select_option("tenant.created")
    page.get_by_role("button", name="Filter").click()
    page.wait_for_url(re.compile(r".*action=tenant\.created.*"))
    actions = page.locator('table.audit td[data-label="Action"]').all_text_contents()
    assert actions == ["tenant.created"] * 3
    assert "3 in all" in page.locator("table.audit caption").inner_text()


def test_a_wrong_code_states_how_long_to_wait(page):
    user, device = make_console_user(roles.OPERATOR)
    page.goto(page.base + "/console/login")
    page.get_by_label("Username").fill(user.username)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Continue").click()
    page.wait_for_url("**/console/login/verify**")
    page.get_by_label("6-digit code").fill(f"{(int(totp_code(device)) + 1) % 1_000_000:06d}")
    page.get_by_role("button", name="Sign in").click()
    assert page.locator("#login-error").inner_text() == "Wrong username, password or code. Try again in 1 s."
    page.get_by_label("6-digit code").fill(totp_code(device))  # at once: inside the wait
    page.get_by_role("button", name="Sign in").click()
    message = page.locator("#login-error").inner_text()
    assert re.fullmatch(r"Too many wrong codes: try again in [12] s\.", message), message


def test_the_404_page_keeps_the_navigation(signed_in):
    page, _ = signed_in(roles.READ_ONLY)
    answer = page.goto(page.base + "/console/no/such/page")
    assert answer.status == 404
    assert page.get_by_role("heading", level=1).inner_text() == "Not found"
    nav = page.get_by_role("navigation", name="Sections")
    assert nav.get_by_role("link").all_text_contents() == ["Overview", "Tenants", "Nodes", "Audit", "GDPR"]
    nav.get_by_role("link", name="Nodes").click()
    page.wait_for_url("**/console/nodes/")
    assert not page.js_errors
