"""Real concurrent requests (threads, one PostgreSQL connection each) never push a tenant past its quota."""

import threading
from collections import Counter

import pytest

from caches.models import Cache, CacheState, DataToken
from tests.caches.conftest import BLOCK_BYTES, attach_body, make_ready, purge_node_queue, reserved, run_in_thread

pytestmark = pytest.mark.django_db(transaction=True)
NUM_THREADS = 8


def _race(fn, num_threads=NUM_THREADS):
    barrier = threading.Barrier(num_threads)

    def go(i):
        barrier.wait()
        return fn(i)

    threads = [run_in_thread(go, i) for i in range(num_threads)]
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    errors = [t.error for t in threads if t.error is not None]
    assert not errors, errors
    return [t.result for t in threads]


def _codes(responses) -> Counter:
    return Counter(r.json()["error"]["code"] if r.status_code >= 400 else r.status_code for r in responses)


def test_concurrent_attaches_never_exceed_max_caches(make_tenant, node):
    tenant = make_tenant(max_caches=3)
    try:
        responses = _race(lambda i: tenant.client.post("/api/v1/caches", attach_body(name=f"c{i}"), format="json"))
        assert _codes(responses) == Counter({201: 3, "quota_exceeded": NUM_THREADS - 3})
        live = Cache.objects.filter(tenant=tenant.tenant).exclude(state=CacheState.DETACHED)
        assert live.count() == 3
        assert reserved(node)["device"] == sum(c.device_capacity_bytes for c in live)
    finally:
        purge_node_queue(node.pk)


def test_concurrent_attaches_never_exceed_bytes(make_tenant, node):
    size = 10 * BLOCK_BYTES
    tenant = make_tenant(max_caches=100, max_dram_bytes=5 * size - 1)  # room for 4 caches, not 5
    try:
        responses = _race(
            lambda i: tenant.client.post(
                "/api/v1/caches", attach_body(name=f"c{i}", device=BLOCK_BYTES, dram=size), format="json"
            )
        )
        assert _codes(responses) == Counter({201: 4, "quota_exceeded": NUM_THREADS - 4})
        live = Cache.objects.filter(tenant=tenant.tenant).exclude(state=CacheState.DETACHED)
        assert sum(c.dram_capacity_bytes for c in live) == 4 * size
        assert reserved(node)["dram"] == 4 * size
    finally:
        purge_node_queue(node.pk)


def test_concurrent_token_requests_respect_the_outstanding_limit(make_tenant, node):
    tenant = make_tenant(max_data_tokens_outstanding=3)
    try:
        cache_id = tenant.client.post("/api/v1/caches", attach_body(), format="json").json()["id"]
        make_ready(cache_id)
        responses = _race(lambda i: tenant.client.post(f"/api/v1/caches/{cache_id}/tokens", {}, format="json"))
        assert _codes(responses) == Counter({201: 3, "quota_exceeded": NUM_THREADS - 3})
        assert DataToken.objects.filter(tenant=tenant.tenant).count() == 3
    finally:
        purge_node_queue(node.pk)
