"""The overview: fleet capacity/reserved/resident per tier over nodes not lost, nodes and caches by state (every
state, zeros too), the hit rate from heartbeat counters of live nodes, top tenants by GB-hours this UTC month; the
live part as a fragment for htmx polls."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.utils import timezone

from billing.invoices import month_start
from billing.models import LedgerHour
from caches import services as cache_services
from fleet import services as fleet_services
from tests.console.nodes_fixtures import BLOCK, GIB, attach, heartbeat, make_failed, make_node, make_ready, make_tenant

pytestmark = pytest.mark.django_db
GB_HOUR = 3600 * 10**9  # byte-seconds


@pytest.fixture
def fleet():
    """lost (2 GiB, 1000 hits: counts nowhere), ready n1 (8 GiB device, 16 GiB dram), cordoned n2 (4 GiB),
    registering n4; caches on n1 in states ready, failed, provisioning, detaching, detached."""
    lost = make_node("n3-lost", device=2 * GIB)
    heartbeat(lost, [{"cache_id": "00000000-0000-4000-8000-000000000001", "device_bytes": GIB, "hit_tokens": 1000}])
    assert fleet_services.nodes_expire_leases(now=timezone.now() + timedelta(seconds=60)) == [lost.pk]
    n1 = make_node("n1", device=8 * GIB, dram=16 * GIB)
    n2 = make_node("n2", device=4 * GIB)
    fleet_services.node_cordon(node_id=n2.pk)
    make_node("n4", register=False)
    acme = make_tenant("acme")
    ready = make_ready(attach(acme, "ready"))
    make_failed(attach(acme, "failed"))
    attach(acme, "provisioning")
    detaching = make_ready(attach(acme, "detaching"))
    cache_services.cache_detach(cache_id=detaching.pk, tenant_id=acme.pk)
    detached = make_ready(attach(acme, "detached"))
    cache_services.cache_detach(cache_id=detached.pk, tenant_id=acme.pk)
    cache_services.cache_detach_result(cache_id=detached.pk, node_id=n1.pk)
    heartbeat(
        n1,
        [
            {
                "cache_id": str(ready.pk),
                "device_bytes": 4 * BLOCK,
                "dram_bytes": 2 * BLOCK,
                "hit_tokens": 30,
                "miss_tokens": 10,
            }
        ],
    )
    heartbeat(n2, [{"cache_id": "00000000-0000-4000-8000-000000000002", "device_bytes": BLOCK, "hit_tokens": 10}])
    return {"n1": n1, "n2": n2, "acme": acme, "ready": ready}


def _cell(html: str, attribute: str, state: str) -> int:
    return int(re.search(rf'{attribute}="{state}">(\d+)<', html).group(1))


def test_overview_shows_capacity_states_and_hit_rate(operator_client, fleet):
    page = operator_client.get("/console/")
    assert page.status_code == 200
    html = page.content.decode()
    tiers = {t.tier: t for t in page.context["tiers"]}
    assert tiers["device"].capacity_bytes == 12 * GIB  # lost node's 2 GiB left out, registering node's 0
    assert tiers["device"].reserved_bytes == 3 * 8 * BLOCK  # ready, provisioning, detaching
    assert tiers["device"].resident_bytes == 4 * BLOCK + BLOCK and tiers["dram"].resident_bytes == 2 * BLOCK
    assert tiers["dram"].capacity_bytes == 16 * GIB and tiers["ssd"].capacity_bytes == 0
    assert f'max="{12 * GIB}" value="{24 * BLOCK}"' in html  # the device reserved <meter>
    assert {s: _cell(html, "data-node-state", s) for s in ("ready", "cordoned", "lost", "registering", "draining")} == {
        "ready": 1,
        "cordoned": 1,
        "lost": 1,
        "registering": 1,
        "draining": 0,
    }
    cache_counts = {
        s: _cell(html, "data-cache-state", s)
        for s in ("pending", "provisioning", "ready", "failed", "detaching", "detached")
    }
    assert cache_counts == {"pending": 0, "provisioning": 1, "ready": 1, "failed": 1, "detaching": 1, "detached": 1}
    assert '<p class="stat" id="hit-rate">80.0%</p>' in html  # 40 hits of 50 reads; the lost node's 1000 left out
    assert "40 tokens served from cache, 10 asked and not cached" in html
    assert 'hx-get="/console/overview/live"' in html and 'hx-trigger="every 5s"' in html


def test_hit_rate_is_na_without_reads(operator_client):
    make_node("quiet")
    html = operator_client.get("/console/").content.decode()
    assert '<p class="stat" id="hit-rate">n/a</p>' in html
    assert all(_cell(html, "data-node-state", s) == 0 for s in ("lost", "draining", "cordoned", "registering"))


def test_live_partial_is_only_the_fragment_for_htmx(readonly_client, fleet):
    live = readonly_client.get("/console/overview/live", HTTP_HX_REQUEST="true", HTTP_X_CONSOLE_POLL="1")
    html = live.content.decode()
    assert live.status_code == 200 and live["Cache-Control"] == "no-store"
    assert html.lstrip().startswith('<div id="overview-live"')
    assert "<html" not in html and "Top tenants" not in html
    assert '<p class="stat" id="hit-rate">80.0%</p>' in html
    full = readonly_client.get("/console/overview/live")
    assert full.status_code == 200 and b"<html" in full.content and b"Top tenants" in full.content


def _ledger(cache, hour, *, device=0, dram=0, ssd=0):
    LedgerHour.objects.create(
        cache=cache,
        tenant_id=cache.tenant_id,
        hour=hour,
        device_byte_seconds=device,
        dram_byte_seconds=dram,
        ssd_byte_seconds=ssd,
    )


def test_top_tenants_by_gb_hours_this_month_link_to_the_tenant(compliance_client, fleet):
    this_month = month_start(timezone.now())
    acme_cache = fleet["ready"]
    globex = make_tenant("globex")
    globex_cache = make_ready(attach(globex, "g"))
    _ledger(acme_cache, this_month, device=2 * GB_HOUR, dram=GB_HOUR)  # 3 GB-hours
    _ledger(acme_cache, this_month - timedelta(hours=1), device=100 * GB_HOUR)  # last month: not counted
    _ledger(globex_cache, this_month + timedelta(hours=1), ssd=5 * GB_HOUR)  # 5 GB-hours
    page = compliance_client.get("/console/")
    rows = [(r["usage"].tenant_name, r["usage"].gb_hours, r["url"]) for r in page.context["top_tenants"]]
    assert [(name, hours) for name, hours, _ in rows] == [("globex", 5), ("acme", 3)]
    assert rows[0][2].endswith(f"/console/tenants/{globex.pk}/")
    html = page.content.decode()
    assert html.index(">globex</a>") < html.index(">acme</a>") and "5.000" in html and "3.000" in html


def test_overview_without_usage_says_so(operator_client):
    assert b"No usage ledgered this month yet." in operator_client.get("/console/").content


def test_signed_out_poll_gets_a_redirect_header(client, db):
    answer = client.get("/console/overview/live", HTTP_HX_REQUEST="true")
    assert answer.status_code == 204 and answer["HX-Redirect"].startswith("/console/login")
