"""The routing index of a tenant's caches (routing.cache_index), fed batches as the follower reads them from a node:
each batch once and in order; a lookup answers per cache and per tier; a new log (the cache moved or was provisioned
again) or one that dropped unread batches leaves nothing stale advertised; erasure forgets it all."""

import pytest

from caches import services as cache_services
from caches.models import Cache
from kcaas.kv_events import BlockRemoved, BlockStored, EventBatch
from kcaas.spec import KVCacheSpec
from routing import cache_index, services
from routing.models import CacheFollow, IndexedBlock
from tests.caches.conftest import make_node, node  # noqa: F401 - fixtures

pytestmark = pytest.mark.django_db

SPEC = KVCacheSpec("tiny-llama@v1", 2, 2, 8, 4, "float16", "float16")
PROMPT = list(range(200, 214))  # 3 whole blocks of 4


def batch(*events) -> EventBatch:
    return EventBatch(0.0, tuple(events))


def attached(handle, node, name="chat") -> Cache:
    cache = cache_services.cache_attach(
        tenant_id=handle.tenant.pk, name=name, spec=SPEC, capacity={"device": 64 * SPEC.block_bytes}
    )
    Cache.objects.filter(pk=cache.pk).update(node=node, endpoint="10.1.0.1:7000")
    return Cache.objects.get(pk=cache.pk)


def caches_seen(handle, tokens) -> dict:
    answer = handle.client.post("/api/v1/engines/lookup", {"model": "m", "token_ids": tokens}, format="json")
    assert answer.status_code == 200, answer.json()
    return {hit["name"]: hit["prefix_tokens"] for hit in answer.json()["caches"]}


def test_batches_apply_in_order_and_a_lookup_answers_per_tier(tenant_a, tenant_b, node):
    cache = attached(tenant_a, node)
    attached(tenant_b, node, name="theirs")
    assert caches_seen(tenant_a, PROMPT) == {}  # not followed yet: not offered
    cache_index.follow_start(cache_id=cache.pk, endpoint=cache.endpoint, epoch=cache.epoch)
    gpu = BlockStored((b"a", b"b"), None, tuple(PROMPT[:8]), 4, "GPU")
    cpu = BlockStored((b"c",), b"b", tuple(PROMPT[8:12]), 4, "CPU")
    assert not cache_index.apply_cache_batch(cache_id=cache.pk, seq=1, batch=batch(cpu))  # seq 0 comes first
    assert cache_index.apply_cache_batch(cache_id=cache.pk, seq=0, batch=batch(gpu))
    assert cache_index.apply_cache_batch(cache_id=cache.pk, seq=1, batch=batch(cpu))
    assert not cache_index.apply_cache_batch(cache_id=cache.pk, seq=1, batch=batch(cpu))  # applied already
    assert caches_seen(tenant_a, PROMPT) == {"chat": {"GPU": 8, "CPU": 12}}
    assert caches_seen(tenant_b, PROMPT) == {}  # B's cache is not followed, and A's is never B's

    assert cache_index.apply_cache_batch(cache_id=cache.pk, seq=2, batch=batch(BlockRemoved((b"b",), "GPU")))
    assert caches_seen(tenant_a, PROMPT) == {"chat": {"GPU": 4, "CPU": 4}}  # block 2 (CPU) no longer follows on


def test_a_new_log_or_dropped_batches_leave_nothing_stale_and_erasure_forgets_it(tenant_a, node):
    cache = attached(tenant_a, node)
    cache_index.follow_start(cache_id=cache.pk, endpoint=cache.endpoint, epoch=cache.epoch)
    stored = BlockStored((b"a",), None, tuple(PROMPT[:4]), 4, "GPU")
    assert cache_index.apply_cache_batch(cache_id=cache.pk, seq=0, batch=batch(stored))
    same = cache_index.follow_start(cache_id=cache.pk, endpoint=cache.endpoint, epoch=cache.epoch)
    assert same.next_seq == 1 and caches_seen(tenant_a, PROMPT) == {"chat": {"GPU": 4}}  # the same log: kept

    moved = cache_index.follow_start(cache_id=cache.pk, endpoint="10.1.0.2:7000", epoch=cache.epoch + 1)
    assert moved.next_seq == 0 and caches_seen(tenant_a, PROMPT) == {"chat": {}}

    assert cache_index.apply_cache_batch(cache_id=cache.pk, seq=0, batch=batch(stored))
    cache_index.follow_restart(cache_id=cache.pk, next_seq=5, gap=True)  # batches 1-4 dropped before they were read
    follow = CacheFollow.objects.get(cache_id=cache.pk)
    assert (follow.next_seq, follow.gaps) == (5, 1) and caches_seen(tenant_a, PROMPT) == {"chat": {}}

    assert cache_index.apply_cache_batch(cache_id=cache.pk, seq=5, batch=batch(stored))
    services.instances_forget_tenant(tenant_id=tenant_a.tenant.pk)
    assert not CacheFollow.objects.exists() and not IndexedBlock.objects.exists()


def test_the_reader_backs_off_a_silent_node_on_one_token_outside_the_tenants_quota(tenant_a, node):
    from caches.models import CacheState, DataToken
    from caches.selectors import data_tokens_outstanding
    from routing.cache_follower import CacheFollower
    from tenants import services as tenant_services
    from tests.faults import free_port

    cache = attached(tenant_a, node)
    Cache.objects.filter(pk=cache.pk).update(state=CacheState.READY, endpoint=f"127.0.0.1:{free_port()}")
    tenant_services.quota_update(tenant=tenant_a.tenant, max_data_tokens_outstanding=0)  # none left for its engines
    follower = CacheFollower(timeout_s=2.0)
    try:
        assert follower.step() == 0 and follower.step() == 0  # refused, then not retried within its backoff
        assert DataToken.objects.filter(cache_id=cache.pk).count() == 1  # one token, not one per round
        # the platform's own reader: issued whatever the tenant's quota, and not counted in it
        assert DataToken.objects.get(cache_id=cache.pk).platform_reader
        assert data_tokens_outstanding(tenant_id=tenant_a.tenant.pk) == 0
        assert not IndexedBlock.objects.filter(cache_id=cache.pk).exists()
    finally:
        follower.close()
