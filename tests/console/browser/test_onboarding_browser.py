"""Onboarding in chromium: an operator creates a tenant (a bad limit refused first), sets a quota, issues its first
API key, reads the key from the page, and the key works over real HTTP against the live server's API; the key is on
that one page only (not after going back, not on the tenant's page). Every page of the flow passes the
accessibility checks at laptop and phone width."""

from __future__ import annotations

import pytest

from console import roles
from tenants.models import ApiKey, Quota, Tenant
from tests.console.browser.conftest import LAPTOP, PHONE, accessibility_problems
from tests.console.browser.test_flows_browser import api

pytestmark = pytest.mark.django_db(transaction=True)
GIB = 2**30


def _checked_at_both_widths(page) -> None:
    for size in (PHONE, LAPTOP):
        page.set_viewport_size(size)
        assert accessibility_problems(page) == [], (page.url, size)


def test_onboard_a_tenant_and_its_first_key_works_over_http(signed_in, shots):
    page, user = signed_in(roles.OPERATOR)
    page.goto(page.base + "/console/tenants/")
    page.get_by_role("link", name="New tenant").click()
    page.wait_for_url("**/console/tenants/new")
    _checked_at_both_widths(page)

    page.get_by_label("Name", exact=True).fill("acme-robotics")
    page.get_by_label("Caches", exact=True).fill("-1")  # refused: nothing is created
    page.get_by_role("button", name="Create tenant").click()
    assert "The tenant was not created" in page.get_by_role("alert").filter(has_text="not created").inner_text()
    assert not Tenant.objects.filter(name="acme-robotics").exists()
    assert page.get_by_label("Name", exact=True).input_value() == "acme-robotics"  # what was typed is kept
    page.get_by_label("Caches", exact=True).fill("5")
    page.get_by_label("Device bytes").fill("8 GiB")
    page.get_by_role("button", name="Create tenant").click()
    tenant = Tenant.objects.get(name="acme-robotics")
    page.wait_for_url(f"**/console/tenants/{tenant.pk}/")
    assert "Tenant acme-robotics created." in page.locator(".messages").inner_text()

    page.get_by_label("DRAM bytes").fill("1 GiB")  # the quota, set on the tenant's page
    page.get_by_role("button", name="Save quota").click()
    page.wait_for_url(f"**/console/tenants/{tenant.pk}/#quota")
    quota = Quota.objects.get(tenant=tenant)
    assert (quota.max_caches, quota.max_device_bytes, quota.max_dram_bytes) == (5, 8 * GIB, GIB)

    page.get_by_role("link", name="Issue API key").click()
    page.wait_for_url(f"**/console/tenants/{tenant.pk}/keys/new")
    _checked_at_both_widths(page)
    page.get_by_label("Name", exact=True).fill("first engine")
    page.get_by_label("keys:read").check()
    page.get_by_role("button", name="Issue API key").click()
    raw_key = page.locator("#new-key").inner_text().strip()
    assert raw_key.startswith("kc_live_")
    main = page.locator("main").inner_text()
    assert "shown only this once" in main
    assert f"export KCAAS_URL={page.base} KCAAS_API_KEY={raw_key}" in page.locator("#export-line").inner_text()
    page.get_by_role("button", name="Copy key").click()  # the copy button works (no inline script)
    page.locator("#copy-status").filter(has_text="Cop").or_(
        page.locator("#copy-status").filter(has_text="Sel")
    ).wait_for()
    _checked_at_both_widths(page)
    page.screenshot(path=str(shots / "key-issued.png"), full_page=True)

    status, body = api(page.base, "GET", "/api/v1/whoami", raw_key)
    api_key = ApiKey.objects.get(tenant=tenant)
    assert status == 200, body
    assert body == {
        "kind": "tenant_key",
        "tenant_id": str(tenant.pk),
        "key_id": str(api_key.pk),
        "scopes": ["caches:write", "keys:read", "usage:read"],
    }
    assert api(page.base, "GET", "/api/v1/keys", raw_key)[0] == 200

    secret = raw_key.split("_", 3)[3]
    page.go_back()  # the form again, never the key
    page.wait_for_url(f"**/console/tenants/{tenant.pk}/keys/new")
    assert secret not in page.content()
    page.goto(page.base + f"/console/tenants/{tenant.pk}/")
    assert api_key.public_id in page.content() and secret not in page.content()
    assert "first engine" in page.get_by_role("row").filter(has_text=api_key.public_id).inner_text()
    assert ApiKey.objects.filter(tenant=tenant).count() == 1
    assert not page.js_errors
