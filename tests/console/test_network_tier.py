"""The network tier in the console, wherever the tiers show: a tenant's caches (network bytes, write-through), its
quota meters and quota form (max_network_bytes, read by the one quota parser), and the overview's fleet tiers (the
network store: its size, the bytes granted to caches, what nodes report resident in it)."""

from __future__ import annotations

import pytest

from caches import services as cache_services
from fleet.models import Node
from kcaas.spec import KVCacheSpec
from tests.caches.conftest import SPEC
from tests.console.test_tenants import (
    BLANK_QUOTA,
    CACHE_DEVICE_BYTES,
    GIB,
    followed_messages,
    make_node,
    make_tenant,
    quota_row,
    text,
)

pytestmark = pytest.mark.django_db
STORE = 10 * GIB


@pytest.fixture
def store(settings):
    settings.KCAAS_NETWORK_STORE_BYTES = STORE


def _attach(tenant, name: str, network: int, write_through: bool = False):
    return cache_services.cache_attach(
        tenant_id=tenant.pk,
        name=name,
        spec=KVCacheSpec(**SPEC),
        capacity={"device": CACHE_DEVICE_BYTES, "network": network},
        network_write_through=write_through,
    )


def test_the_tenant_page_shows_network_bytes_quota_and_write_through(readonly_client, store):
    tenant = make_tenant("acme", max_network_bytes=4 * GIB)
    node = make_node()
    cache = _attach(tenant, "net-cache", GIB, write_through=True)
    _attach(tenant, "plain-cache", 0)
    snapshot = {"caches": {str(cache.pk): {"device": 1024, "network": 512 * 1024}}}
    Node.objects.filter(pk=node.pk).update(resident_snapshot=snapshot)
    page = readonly_client.get(f"/console/tenants/{tenant.pk}/")
    assert page.status_code == 200
    html = text(page)
    assert "1 GiB of 4 GiB reserved (512 KiB resident)" in html  # the Network quota meter
    assert f'max="{4 * GIB}" value="{GIB}"' in html
    assert '<th scope="col" class="num hide-narrow">Network</th>' in html
    assert '<span class="badge">write-through</span>' in html and html.count("write-through</span>") == 1
    assert '<span class="swatch network"></span>Network' in html


def test_the_quota_form_sets_network_bytes_with_units(operator_client):
    tenant = make_tenant("acme")
    form = {**BLANK_QUOTA, "max_network_bytes": "2 TiB"}
    answer = operator_client.post(f"/console/tenants/{tenant.pk}/quota", form)
    assert "Network bytes: default (256 GiB) -&gt; 2 TiB" in followed_messages(operator_client, answer)
    assert quota_row(tenant)["max_network_bytes"] == 2 * 2**40
    bad = operator_client.post(f"/console/tenants/{tenant.pk}/quota", {**form, "max_network_bytes": "2TB"})
    assert bad.status_code == 400 and quota_row(tenant)["max_network_bytes"] == 2 * 2**40


def test_the_overview_shows_the_network_store_after_the_node_tiers(operator_client, store):
    tenant = make_tenant("acme")
    node = make_node()
    cache = _attach(tenant, "net-cache", 3 * GIB)
    Node.objects.filter(pk=node.pk).update(resident_snapshot={"caches": {str(cache.pk): {"network": GIB}}})
    page = operator_client.get("/console/")
    tiers = [t.tier for t in page.context["tiers"]]
    assert tiers == ["device", "dram", "ssd", "network"]
    network = page.context["tiers"][-1]
    assert (network.capacity_bytes, network.reserved_bytes, network.resident_bytes) == (STORE, 3 * GIB, GIB)
    assert f'max="{STORE}" value="{3 * GIB}"' in text(page)


def test_without_a_network_store_the_overview_says_so(operator_client, settings):
    settings.KCAAS_NETWORK_STORE_BYTES = 0
    html = text(operator_client.get("/console/"))
    assert "no network capacity" in html


def test_a_node_page_shows_its_caches_bytes_in_the_network_store(operator_client, store):
    tenant = make_tenant("acme-node", max_network_bytes=4 * GIB)
    node = make_node()
    cache = _attach(tenant, "net-cache", GIB, write_through=True)
    snapshot = {"caches": {str(cache.pk): {"device": 1024, "network": 512 * 1024}}}
    Node.objects.filter(pk=node.pk).update(resident_snapshot=snapshot)
    html = text(operator_client.get(f"/console/nodes/{node.pk}/"))
    assert "its caches hold 512 KiB of 1 GiB in the fleet's network store" in html
    assert f'max="{GIB}" value="{512 * 1024}"' in html
