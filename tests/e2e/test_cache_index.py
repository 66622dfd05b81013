"""The routing index follows each tenant's caches (routing.cache_follower, reading an agent process's data plane
over TLS with tokens the control plane issues it): a lookup answers, per cache and per tier, the prefix the cache's
device pool and DRAM hold, as their block events say; a delete or a detach leaves the index; another tenant's lookup
sees only its own caches, never a block of these."""

from __future__ import annotations

import pytest

import kcaas
from audit.actions import AuditAction
from audit.models import AuditEvent
from caches.models import Cache
from routing.cache_follower import CacheFollower
from routing.models import CacheFollow
from tests.e2e.conftest import client_tls, random_kv, random_tokens, spec_for, tenant_dataplane, tenant_key

pytestmark = pytest.mark.django_db(transaction=True)


def caches_seen(client, tokens) -> dict[str, dict[str, int]]:
    return {hit.name: hit.prefix_tokens for hit in client.prefix_lookup("any-model", tokens.tolist()).caches}


def test_a_lookup_answers_per_cache_and_tier_and_another_tenant_sees_none_of_it(
    live_server, agent_launcher, model, pki, monkeypatch
):
    spec = spec_for(model)
    monkeypatch.setenv("KCAAS_NODE_DRAM_BYTES", str(64 * spec.block_bytes))
    agent_launcher.start()
    a, b = kcaas.Client(live_server.url, tenant_key()), kcaas.Client(live_server.url, tenant_key())
    cache_a = a.attach("indexed", spec, {"device": 4 * spec.block_bytes, "dram": 16 * spec.block_bytes}, timeout=30)
    b.attach("theirs", spec, {"device": 4 * spec.block_bytes}, timeout=30)
    writer = tenant_dataplane(a, cache_a, spec, pki)
    follower = CacheFollower(ssl_context=client_tls(pki))
    size = spec.block_size
    try:
        first, second = random_tokens(4 * size, seed=1)[0], random_tokens(4 * size, seed=2)[0]
        writer.put(first, random_kv(spec, 4 * size, seed=1))
        writer.put(second, random_kv(spec, 4 * size, seed=2))  # the device holds 4 blocks: the first go to DRAM
        assert follower.step() > 0
        assert caches_seen(a, first) == {"indexed": {"CPU": 4 * size}}  # in DRAM only: GPU has none of it
        assert caches_seen(a, second) == {"indexed": {"GPU": 4 * size}}
        longer = random_tokens(6 * size, seed=2)[0]  # the second prompt and more: its first 4 blocks are held
        assert caches_seen(a, longer)["indexed"] == {"GPU": 4 * size}
        assert writer.lookup(first) == 4 * size  # what the index advertises, the node serves

        assert caches_seen(b, first) == {"theirs": {}} and caches_seen(b, second) == {"theirs": {}}
        tenant_a = Cache.objects.get(pk=cache_a.id).tenant_id  # the follower's token: issued and audited as A's
        assert AuditEvent.objects.filter(action=AuditAction.DATA_TOKEN_ISSUED, tenant_id=tenant_a).exists()

        writer.delete(second)
        follower.step()
        assert caches_seen(a, second) == {"indexed": {}}
        writer.close()
        a.detach(cache_a.id, wait=True, timeout=30)
        follower.step()
        assert caches_seen(a, first) == {} and not CacheFollow.objects.filter(cache_id=cache_a.id).exists()
    finally:
        writer.close()
        follower.close()
