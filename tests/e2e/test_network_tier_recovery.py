"""The network tier end to end, with real processes: two node agents pointed at a real Mooncake Store (master and
store server), the live control plane on PostgreSQL and its Celery worker, the SDK over the TLS data plane.

A cache with a small device pool and write-through to the network tier takes more puts than its device holds:
evicted blocks are demoted to the store and promoted back bit-exact through the data plane. Then its node is
SIGKILLed: once its lease runs out the cache is `node_lost`; the tenant asks for it back (`recover`), it is placed on
the other node, and every put the dead node acknowledged reads back bit-exact from the store."""

from __future__ import annotations

import pytest
import torch
from django.utils import timezone

import kcaas
from caches.models import Cache
from fleet.models import Node
from kcaas.dataplane import DataPlaneClient
from kcaas.tokens import TokenSource
from tests.e2e.conftest import client_tls, random_kv, random_tokens, spec_for, tenant_key
from tests.e2e.test_service_crash import sweep
from tests.waiting import eventually

pytestmark = pytest.mark.django_db(transaction=True)
SEQ_TOKENS = 64  # 4 full blocks of 16
NUM_PUTS = 6  # 24 blocks through an 8-block device pool


def data_plane(client, cache, spec, pki) -> DataPlaneClient:
    tokens = TokenSource(client, cache.id, access="readwrite")
    return DataPlaneClient(cache.endpoint, tokens, cache.id, spec, ssl_context=client_tls(pki), timeout=10.0)


def assert_reads_back(dp: DataPlaneClient, acked) -> None:
    for tokens, kv in acked:
        n, got = dp.get(tokens)
        assert n == SEQ_TOKENS and torch.equal(got, kv), f"read {n} tokens"


def test_a_killed_nodes_write_through_cache_comes_back_on_another_node_from_the_network_tier(
    live_server, agent_launcher, pki, model, settings, monkeypatch, network_store
):
    spec = spec_for(model)
    settings.KCAAS_NODE_HEARTBEAT_SECONDS = 1  # the live server is a thread of this process: it answers with these
    settings.KCAAS_NODE_LEASE_SECONDS = 4
    settings.KCAAS_NETWORK_STORE_BYTES = 1 << 30
    for name, value in network_store.env().items():
        monkeypatch.setenv(name, value)
    agents = {agent.node_id: agent for agent in (agent_launcher.start(), agent_launcher.start())}
    client = kcaas.Client(live_server.url, tenant_key())
    try:
        capacity = {"device": 8 * spec.block_bytes, "network": 64 * spec.block_bytes}
        cache = client.attach("durable", spec, capacity, network_write_through=True, timeout=30)
        acked = []
        with data_plane(client, cache, spec, pki) as dp:
            for seed in range(NUM_PUTS):
                tokens, kv = random_tokens(SEQ_TOKENS, seed=100 + seed)[0], random_kv(spec, SEQ_TOKENS, seed=200 + seed)
                assert dp.put(tokens, kv)["num_cached"] == SEQ_TOKENS
                acked.append((tokens, kv))
            assert_reads_back(dp, acked)  # the early ones were evicted: promoted back from the store
        (lost,) = [node_id for node_id in agents if node_id == Cache.objects.get(pk=cache.id).node_id]
        (spare,) = set(agents) - {lost}
        agents[lost].kill()
        assert eventually(lambda: Node.objects.get(pk=lost).lease_expires_at < timezone.now(), timeout=10)
        sweep()
        assert client.get_cache(cache.id).failure_reason == "node_lost"

        recovered = client.recover(cache.id)
        assert recovered.node_id == str(spare) and recovered.epoch == cache.epoch + 1
        assert eventually(lambda: client.get_cache(cache.id).state == "ready", timeout=30)
        ready = client.get_cache(cache.id)
        assert ready.endpoint == agents[spare].endpoint
        with data_plane(client, ready, spec, pki) as dp:
            assert_reads_back(dp, acked)  # every acknowledged put, bit-exact, from the network tier
    finally:
        client.close()
