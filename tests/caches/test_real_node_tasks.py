"""The control plane and the node agent's real Celery side (gpu_node/node_tasks.py + CacheRegistry), over the
real broker: attach -> the node allocates a PagedKVCache with the cache's sealed hash key -> ready; detach frees it;
a request the node cannot fit is answered failed with the node's reason."""

import os
import time
import uuid

import pytest
import torch

from caches.models import Cache
from caches.sealing import hash_key_unseal
from controlplane.celery import app as control_app, node_queue
from fleet.models import Node
from gpu_node.block_hash import BlockHasher, tokens_as_int32
from gpu_node.node_tasks import build_node_app
from gpu_node.registry import CacheRegistry
from tests.waiting import eventually
from tests.caches.conftest import (
    BLOCK_BYTES,
    attach_body,
    purge_node_queue,
    reserved,
    running_workers,
    wait_for_state,
)

pytestmark = pytest.mark.django_db(transaction=True)

NODE_ID = uuid.UUID("6e0de000-0000-4000-8000-0000000a6e17")
ENDPOINT = "10.7.0.1:7070"
NODE_DEVICE_BYTES = 100 * BLOCK_BYTES


@pytest.fixture(scope="module")
def node_registry():
    registry = CacheRegistry(device_capacity_bytes=NODE_DEVICE_BYTES, device="cpu")
    node_app = build_node_app(
        broker_url=os.environ["CELERY_BROKER_URL"], node_id=str(NODE_ID), endpoint=ENDPOINT, registry=registry
    )
    try:
        with running_workers((control_app, ["control"]), (node_app, [node_queue(NODE_ID)])):
            yield registry
    finally:
        purge_node_queue(NODE_ID)


@pytest.fixture
def node(make_node, node_registry):
    made = make_node(device=NODE_DEVICE_BYTES * 10)  # the control plane believes more than the agent has
    Node.objects.filter(pk=made.pk).update(id=NODE_ID, endpoint=ENDPOINT)
    return Node.objects.get(pk=NODE_ID)


def test_the_node_hosts_the_cache_with_its_sealed_key_and_frees_it_on_detach(tenant_a, node, node_registry):
    response = tenant_a.client.post("/api/v1/caches", attach_body(device=16 * BLOCK_BYTES), format="json")
    assert response.status_code == 201
    cache_id = response.json()["id"]
    ready = wait_for_state(tenant_a.client, cache_id, "ready")
    assert ready["endpoint"] == ENDPOINT

    hosted = node_registry.get(cache_id)
    assert hosted is not None and hosted.epoch == 1 and hosted.engine.stats().num_blocks == 16
    cache = Cache.objects.get(pk=cache_id)
    key = hash_key_unseal(cache_id=cache.pk, sealed=cache.hash_key_sealed)
    tokens = tokens_as_int32(list(range(20)))
    kv = torch.randn(2, 2, 20, 2, 8).to(torch.float16)
    hosted.engine.put(tokens, kv)
    expected = set(BlockHasher(key, 16, hosted.spec.model_fingerprint).block_hashes(tokens))
    assert expected <= set(hosted.engine._blocks.cached_hash_to_block)  # keyed with the control plane's secret

    assert tenant_a.client.delete(f"/api/v1/caches/{cache_id}").status_code == 202
    wait_for_state(tenant_a.client, cache_id, "detached")
    assert node_registry.get(cache_id) is None


def test_a_cache_the_node_cannot_fit_fails_with_the_nodes_reason(tenant_a, node, node_registry):
    response = tenant_a.client.post("/api/v1/caches", attach_body("big", device=200 * BLOCK_BYTES), format="json")
    assert response.status_code == 201  # the control plane's view of the node had room
    failed = wait_for_state(tenant_a.client, response.json()["id"], "failed")
    assert failed["failure_reason"] == "insufficient_capacity"
    assert reserved(node)["device"] == 0
    deadline = time.monotonic() + 5
    while node_registry.cache_ids() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert node_registry.cache_ids() == []


def test_a_move_to_a_node_without_a_migration_listener_fails_at_once(tenant_a, node, node_registry, make_node):
    """The node app here has no migration listener: a migration whose target it is is refused with a reason right
    away (it used to be discarded as an unregistered task, and the move waited for the stall sweep)."""
    from caches.migration import migration_start
    from caches.models import Migration

    source = make_node(device=NODE_DEVICE_BYTES * 10)
    response = tenant_a.client.post("/api/v1/caches", attach_body("moving", device=16 * BLOCK_BYTES), format="json")
    cache = Cache.objects.get(pk=response.json()["id"])
    Cache.objects.filter(pk=cache.pk).update(node=source, state="ready")  # ready on another node
    moving = migration_start(cache_id=cache.pk, target_node_id=NODE_ID)
    assert eventually(lambda: Migration.objects.get(pk=moving.pk).state == "failed", timeout=20), \
        "the migration was not refused"
    assert Migration.objects.get(pk=moving.pk).failure_reason == "migration_unavailable"
