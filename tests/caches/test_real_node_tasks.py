"""The control plane and the node agent's real Celery side (gpu_node/agent/tasks.py + CacheRegistry), over the
real broker: attach -> the node allocates a PagedKVCache with the cache's sealed hash key -> ready; detach frees it;
a request the node cannot fit is answered failed with the node's reason."""

import base64
import dataclasses
import os
import time
import uuid

import pytest
import torch

from caches.models import Cache
from caches.sealing import hash_key_unseal
from core.celery import app as control_app
from fleet.models import Node
from gpu_node.agent.registry import CacheRegistry
from gpu_node.agent.tasks import build_node_app
from gpu_node.engine.block_hash import BlockHasher, tokens_as_int32
from kcaas.node_protocol.messages import MIGRATE_IN_TASK, PROVISION_TASK, ProvisionCache, node_queue
from kcaas.node_protocol.sealing import NodeSealingKey, seal
from tests.caches.conftest import (
    BLOCK_BYTES,
    attach_body,
    purge_node_queue,
    reserved,
    running_workers,
    wait_for_state,
)
from tests.fleet.node_keys import TEST_SEALING_KEY, TEST_SEALING_PUBLIC_KEY
from tests.waiting import eventually

pytestmark = pytest.mark.django_db(transaction=True)

NODE_ID = uuid.UUID("6e0de000-0000-4000-8000-0000000a6e17")
ENDPOINT = "10.7.0.1:7070"
NODE_DEVICE_BYTES = 100 * BLOCK_BYTES


@pytest.fixture(scope="module")
def node_registry():
    registry = CacheRegistry(device_capacity_bytes=NODE_DEVICE_BYTES, device="cpu")
    node_app = build_node_app(
        broker_url=os.environ["CELERY_BROKER_URL"],
        node_id=str(NODE_ID),
        endpoint=ENDPOINT,
        registry=registry,
        sealing_key=TEST_SEALING_KEY,
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
    assert expected <= {
        meta.key for meta in hosted.engine.exchange.list_blocks()
    }  # keyed with the control plane's secret

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
    assert eventually(lambda: Migration.objects.get(pk=moving.pk).state == "failed", timeout=20), (
        "the migration was not refused"
    )
    assert Migration.objects.get(pk=moving.pk).failure_reason == "migration_unavailable"


# ---- keys sealed to the node (kcaas/node_protocol/sealing.py)
# ----------------------------------------------------------------------
def _attach_unsent(tenant, monkeypatch, name: str) -> tuple[str, ProvisionCache]:
    """An attached cache whose provisioning order the outbox keeps (not published): the test sends the message
    itself. Returns (cache id, the provisioning message the outbox would send, keys sealed to this node)."""
    from caches.services import provision_order_message

    monkeypatch.setattr("fleet.outbox._publish_after_commit", lambda order_id: None)
    response = tenant.client.post("/api/v1/caches", attach_body(name, device=8 * BLOCK_BYTES), format="json")
    assert response.status_code == 201, response.content
    cache_id = response.json()["id"]
    return cache_id, provision_order_message(cache_id, 1)


def _flip_ciphertext(box: str) -> str:
    prefix, text = box[:5], box[5:]
    raw = bytearray(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
    raw[-20] ^= 0x01  # a ciphertext byte (the last 16 are the tag)
    return prefix + base64.urlsafe_b64encode(bytes(raw)).decode().rstrip("=")


def _key_of(cache_id) -> bytes:
    cache = Cache.objects.get(pk=cache_id)
    return hash_key_unseal(cache_id=cache.pk, sealed=cache.hash_key_sealed)


@pytest.mark.parametrize(
    "forge, reason",
    [
        (lambda order, key: _flip_ciphertext(order.hash_key_box), "sealed_key_invalid"),  # altered on the broker
        (
            lambda order, key: seal(
                key,
                public_key_b64=TEST_SEALING_PUBLIC_KEY,
                task=PROVISION_TASK,
                node_id=NODE_ID,
                cache_id=uuid.uuid4(),
                field="hash_key",
            ),
            "sealed_key_invalid",
        ),  # another cache's box
        (
            lambda order, key: seal(
                key,
                public_key_b64=TEST_SEALING_PUBLIC_KEY,
                task=MIGRATE_IN_TASK,
                node_id=NODE_ID,
                cache_id=order.cache_id,
                field="hash_key",
            ),
            "sealed_key_invalid",
        ),  # another task's box
        (
            lambda order, key: base64.b64encode(key).decode(),
            "key_not_sealed",
        ),  # the key in clear (an old control plane)
    ],
    ids=["altered", "another_cache", "another_task", "in_clear"],
)
def test_a_key_box_that_does_not_open_is_answered_failed_and_provisions_nothing(
    tenant_a, node, node_registry, monkeypatch, forge, reason
):
    cache_id, order = _attach_unsent(tenant_a, monkeypatch, "forged")
    forged = dataclasses.replace(order, hash_key_box=forge(order, _key_of(cache_id)))
    control_app.send_task(PROVISION_TASK, kwargs=forged.to_dict(), queue=node_queue(NODE_ID))
    failed = wait_for_state(tenant_a.client, cache_id, "failed")
    assert failed["failure_reason"] == reason
    assert node_registry.get(cache_id) is None  # never provisioned, with a wrong key or any other


def test_a_box_sealed_to_another_nodes_key_is_not_opened_nor_answered(tenant_a, node, node_registry, monkeypatch):
    """Sealed to a key this node does not hold (another node's, or its own before a restart without a kept key): it
    opens nothing and is not answered, so the order that follows, under this node's key, provisions the cache."""
    cache_id, order = _attach_unsent(tenant_a, monkeypatch, "elsewhere")
    other = seal(
        _key_of(cache_id),
        public_key_b64=NodeSealingKey().public_key_b64,
        task=PROVISION_TASK,
        node_id=NODE_ID,
        cache_id=cache_id,
        field="hash_key",
    )
    elsewhere = dataclasses.replace(order, hash_key_box=other)
    control_app.send_task(PROVISION_TASK, kwargs=elsewhere.to_dict(), queue=node_queue(NODE_ID))
    control_app.send_task(
        PROVISION_TASK, kwargs=order.to_dict(), queue=node_queue(NODE_ID)
    )  # after it, in order (solo worker)
    wait_for_state(tenant_a.client, cache_id, "ready")  # a failure answer to the first would have failed it
    hosted = node_registry.get(cache_id)
    tokens = tokens_as_int32(list(range(16)))
    hosted.engine.put(tokens, torch.randn(2, 2, 16, 2, 8).to(torch.float16))
    expected = BlockHasher(_key_of(cache_id), 16, hosted.spec.model_fingerprint).block_hashes(tokens)
    assert set(expected) <= {
        meta.key for meta in hosted.engine.exchange.list_blocks()
    }  # keyed with the cache's own key


# ---- typed messages (kcaas/node_protocol/messages.py): the node refuses what is not exactly one
# ------------------------------
@pytest.mark.parametrize(
    "malform, problem",
    [
        (lambda fields: (tuple(v for k, v in fields.items() if k != "v"), {}), "positional"),  # an old sender's list
        (lambda fields: ((), {k: v for k, v in fields.items() if k != "epoch"}), "'epoch': missing"),
        (lambda fields: ((), {**fields, "epoch": "1"}), "'epoch': must be an integer"),
        (lambda fields: ((), {**fields, "v": 3}), "'v': version 3"),
    ],
    ids=["positional", "missing", "mistyped", "version"],
)
def test_a_malformed_provisioning_order_is_answered_failed_and_provisions_nothing(
    tenant_a, node, node_registry, monkeypatch, malform, problem
):
    cache_id, order = _attach_unsent(tenant_a, monkeypatch, "malformed")
    args, kwargs = malform(order.to_dict())
    control_app.send_task(PROVISION_TASK, args=args, kwargs=kwargs, queue=node_queue(NODE_ID))
    failed = wait_for_state(tenant_a.client, cache_id, "failed")
    assert failed["failure_reason"].startswith("invalid_message: kcaas.node.provision_cache")
    assert problem in failed["failure_reason"]
    assert node_registry.get(cache_id) is None
