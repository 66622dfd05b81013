"""Every page with a small but realistic fleet behind it, at laptop (1280 px) and phone (390 px) width: each page
renders with its data, has no accessibility problem the checker knows, raises no script error, and its screenshot is
written (docs/console/*.png come from `KCAAS_CONSOLE_SCREENSHOTS=docs/console pytest tests/console/browser -k
screenshots`). The confirmations before what cannot be undone are pages too, and are shot with their warning."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from billing.models import LedgerHour
from console import roles
from fleet import services as fleet_services
from privacy import services as privacy_services
from tenants import services as tenant_services
from tests.console.browser.conftest import LAPTOP, accessibility_problems
from tests.console.nodes_fixtures import GIB, attach, heartbeat, make_node, make_ready, make_tenant

pytestmark = pytest.mark.django_db(transaction=True)


def _fleet(*, requested_by: str):
    """Three nodes (one cordoned), four tenants with caches, 30 days of usage for one, an erasure scheduled."""
    nodes = [
        make_node("gpu-a1", device=80 * GIB, dram=512 * GIB, ssd=2048 * GIB),
        make_node("gpu-a2", device=80 * GIB, dram=512 * GIB, ssd=2048 * GIB),
        make_node("gpu-b1", device=141 * GIB, dram=1024 * GIB, ssd=4096 * GIB),
    ]
    tenants = {name: make_tenant(name) for name in ("acme-robotics", "globex-research", "initech", "umbrella-labs")}
    sizes = {
        "acme-robotics": (24, 64, 256),
        "globex-research": (12, 32, 0),
        "initech": (6, 0, 0),
        "umbrella-labs": (2, 8, 64),
    }
    resident: dict = {}
    for name, (device, dram, ssd) in sizes.items():
        tenant_services.quota_update(
            tenant=tenants[name], max_device_bytes=32 * GIB, max_dram_bytes=128 * GIB, max_ssd_bytes=512 * GIB
        )
        cache = make_ready(attach(tenants[name], "llama-3-8b", device=device * GIB, dram=dram * GIB, ssd=ssd * GIB))
        resident.setdefault(cache.node_id, []).append(
            {
                "cache_id": str(cache.pk),
                "device_bytes": device * GIB * 7 // 10,
                "dram_bytes": dram * GIB // 2,
                "ssd_bytes": ssd * GIB // 3,
                "hit_tokens": 9_400_000,
                "miss_tokens": 2_100_000,
            }
        )
        _usage(cache, days=30 if name == "acme-robotics" else 3, device=device, dram=dram, ssd=ssd)
    for node in nodes:
        heartbeat(node, resident.get(node.pk, []))
    fleet_services.node_cordon(node_id=nodes[2].pk)
    privacy_services.erasure_request(tenant_id=tenants["umbrella-labs"].pk, requested_by=requested_by)
    return tenants


def _usage(cache, *, days: int, device: int, dram: int, ssd: int) -> None:
    now = timezone.now().replace(minute=0, second=0, microsecond=0)
    rows = []
    for day in range(days):
        for hour in range(0, 24, 6):
            at = now - timedelta(days=day, hours=hour)
            load = 0.5 + 0.5 * ((day * 7 + hour) % 5) / 4
            rows.append(
                LedgerHour(
                    cache=cache,
                    tenant_id=cache.tenant_id,
                    hour=at,
                    device_byte_seconds=int(device * GIB * 3600 * load * 0.7),
                    dram_byte_seconds=int(dram * GIB * 3600 * load * 0.5),
                    ssd_byte_seconds=int(ssd * GIB * 3600 * load * 0.3),
                )
            )
    LedgerHour.objects.bulk_create(rows)


PHONE_390 = {"width": 390, "height": 844}  # the docs' phone (the layout tests also hold at 375 px)


def _shoot(page, shots, name: str, path: str | None, *, expect: str) -> None:
    """Both widths of the page at `path` (None: the page as it is now, a POST's answer)."""
    for width_name, size in (("laptop", LAPTOP), ("phone", PHONE_390)):
        page.set_viewport_size(size)
        if path is not None:
            page.goto(page.base + path)
        assert expect in page.locator("main").inner_text(), f"{path} lacks {expect!r}"
        assert accessibility_problems(page) == [], (path, width_name)
        # The laptop shot is the whole page; the phone shot is what a phone shows first (one screen).
        page.screenshot(path=str(shots / f"{name}-{width_name}.png"), full_page=size is LAPTOP)
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"), (path, width_name)
        assert (shots / f"{name}-{width_name}.png").stat().st_size > 10_000


def test_screenshots_of_the_main_pages(signed_in, shots):
    page, user = signed_in(roles.OPERATOR, roles.COMPLIANCE)
    tenants = _fleet(requested_by=f"user:{user.pk}")
    acme = tenants["acme-robotics"]
    _shoot(page, shots, "overview", "/console/", expect="acme-robotics")
    _shoot(page, shots, "tenants", "/console/tenants/", expect="globex-research")
    _shoot(page, shots, "tenant-detail", f"/console/tenants/{acme.pk}/", expect="llama-3-8b")
    _shoot(page, shots, "tenant-new", "/console/tenants/new", expect="Initial quota")
    umbrella = tenants["umbrella-labs"]
    _shoot(page, shots, "tenant-erasure", f"/console/tenants/{umbrella.pk}/", expect="Erasure scheduled for")
    _shoot(page, shots, "key-new", f"/console/tenants/{acme.pk}/keys/new", expect="Scopes")
    page.get_by_label("Name").first.fill("ci-runner")
    page.get_by_role("button", name="Issue API key").click()
    _shoot(page, shots, "key-issued", None, expect="kc_live_")
    key = acme.api_keys.get(name="ci-runner")
    _shoot(page, shots, "key-revoke", f"/console/tenants/{acme.pk}/keys/{key.pk}/revoke", expect="data tokens")
    _shoot(page, shots, "tenant-suspend", f"/console/tenants/{acme.pk}/status?status=suspended", expect="Suspend")
    _shoot(page, shots, "nodes", "/console/nodes/", expect="cordoned")
    node_id = acme.caches.get().node_id
    _shoot(page, shots, "node-detail", f"/console/nodes/{node_id}/", expect="acme-robotics")
    _shoot(page, shots, "node-drain", f"/console/nodes/{node_id}/drain", expect="Drain")
    _shoot(page, shots, "audit", "/console/audit/", expect="tenant.created")
    _shoot(page, shots, "audit-export", "/console/audit/export", expect="Export")
    _shoot(page, shots, "gdpr", "/console/gdpr/", expect="umbrella-labs")
    _shoot(page, shots, "gdpr-erasure-new", "/console/gdpr/erasures/new", expect="erasure")
    _shoot(page, shots, "gdpr-export", "/console/gdpr/export", expect="Export")
    page.set_viewport_size(LAPTOP)  # "Requested by" is one of the columns a phone leaves out
    page.goto(page.base + "/console/gdpr/")
    assert f"{user.username} (user:{user.pk})" in page.locator("main").inner_text()
    assert not page.js_errors
