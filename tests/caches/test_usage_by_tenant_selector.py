"""caches.selectors.cache_usage_by_tenant: cache_usage for many tenants in one query (the console's tenants list)."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from caches import selectors
from caches.models import Cache, CacheState
from caches.services import cache_attach
from kcaas.spec import KVCacheSpec
from tests.caches.conftest import BLOCK_BYTES, SPEC

pytestmark = pytest.mark.django_db


def _attach(tenant, name, device_blocks):
    return cache_attach(
        tenant_id=tenant.pk,
        name=name,
        spec=KVCacheSpec(**SPEC),
        capacity={"device": device_blocks * BLOCK_BYTES, "dram": BLOCK_BYTES, "ssd": 0},
    )


def test_counts_and_bytes_per_tenant_match_cache_usage(make_tenant, node):
    a, b, idle = make_tenant(), make_tenant(), make_tenant()
    _attach(a.tenant, "one", 4), _attach(a.tenant, "two", 8)
    gone = _attach(a.tenant, "gone", 16)
    Cache.objects.filter(pk=gone.pk).update(state=CacheState.DETACHED)
    _attach(b.tenant, "only", 2)
    ids = [a.tenant.pk, b.tenant.pk, idle.tenant.pk]
    with CaptureQueriesContext(connection) as queries:
        usage = selectors.cache_usage_by_tenant(tenant_ids=iter(ids))
    assert len(queries) == 1
    assert usage[a.tenant.pk].num_caches == 2
    assert usage[a.tenant.pk].capacity_bytes == {
        "device": 12 * BLOCK_BYTES,
        "dram": 2 * BLOCK_BYTES,
        "ssd": 0,
        "network": 0,
    }
    assert usage[idle.tenant.pk].num_caches == 0 and usage[idle.tenant.pk].capacity_bytes == dict.fromkeys(
        ("device", "dram", "ssd", "network"), 0
    )
    for tenant_id in ids:
        assert usage[tenant_id] == selectors.cache_usage(tenant_id=tenant_id)
