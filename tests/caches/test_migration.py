"""Migration orchestrated by the control plane through the real broker: two node agents' Celery apps (real node
tasks, real registries, real mutual-TLS migration listeners with platform-CA node certificates naming the node ids),
the control worker, PostgreSQL. Drain moves every cache off a node, cordons it for placement, and is audited; the
target holds bit-exact KV at the new epoch; the source answers MOVED and let the cache go."""

import datetime as dt
import os
import uuid

import numpy as np
import pytest
import torch

from audit.actions import AuditAction
from audit.models import AuditEvent
from caches.migration import migration_start
from caches.models import Cache, Migration
from core.celery import app as control_app
from devtools.dev_pki import new_ca, write_node_pki
from fleet.models import OPEN_ORDER_STATES, Node, NodeOrder, NodeState
from gpu_node.agent.registry import CacheRegistry
from gpu_node.agent.tasks import build_node_app
from gpu_node.migration import block_transfer as bt
from gpu_node.migration.fence import MovedError, fences_for
from gpu_node.migration.tasks import NodeMigration
from gpu_node.migration.transfer import MigrationListener, mtls_client_context, mtls_server_context
from kcaas.node_protocol.messages import node_queue
from tests.caches.conftest import BLOCK_BYTES, attach_body, purge_node_queue, reserved, running_workers, wait_for_state
from tests.fleet.node_keys import TEST_SEALING_KEY
from tests.waiting import eventually

pytestmark = pytest.mark.django_db(transaction=True)

SOURCE = uuid.UUID("6e0de000-0000-4000-8000-00000000a001")
TARGET = uuid.UUID("6e0de000-0000-4000-8000-00000000a002")
ENDPOINTS = {SOURCE: "10.7.1.1:7070", TARGET: "10.7.1.2:7070"}
DEVICE = {SOURCE: 40 * BLOCK_BYTES, TARGET: 80 * BLOCK_BYTES}  # best fit puts new caches on the smaller source


def _files(files):
    return {"cert_file": files["cert"], "key_file": files["key"], "ca_file": files["ca"]}


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    directory = tmp_path_factory.mktemp("node-pki")
    ca_key, ca_cert = new_ca("platform CA (test)", valid_for=dt.timedelta(hours=1))
    sides, apps = {}, []
    for node_id in (SOURCE, TARGET):
        files = write_node_pki(directory, ca_key, ca_cert, str(node_id))
        registry = CacheRegistry(device_capacity_bytes=DEVICE[node_id], device="cpu")
        listener = MigrationListener(registry, mtls_server_context(**_files(files))).start()
        migration = NodeMigration(
            registry=registry,
            node_id=str(node_id),
            listener=listener,
            client_context=mtls_client_context(**_files(files)),
        )
        app = build_node_app(
            broker_url=os.environ["CELERY_BROKER_URL"],
            node_id=str(node_id),
            endpoint=ENDPOINTS[node_id],
            registry=registry,
            migration=migration,
            sealing_key=TEST_SEALING_KEY,
        )
        sides[node_id] = (registry, migration)
        apps.append((app, [node_queue(node_id)]))
    try:
        with running_workers((control_app, ["control"]), *apps):
            yield sides
    finally:
        for node_id in (SOURCE, TARGET):
            sides[node_id][1].listener.stop()
            purge_node_queue(node_id)


@pytest.fixture
def fleet(make_node, nodes):
    for node_id in (SOURCE, TARGET):
        made = make_node(device=DEVICE[node_id])
        Node.objects.filter(pk=made.pk).update(id=node_id, endpoint=ENDPOINTS[node_id])
    return nodes


def ready_cache_with_data(tenant, registry, name: str, seed: int):
    response = tenant.client.post("/api/v1/caches", attach_body(name, device=8 * BLOCK_BYTES), format="json")
    assert response.status_code == 201, response.content
    cache_id = wait_for_state(tenant.client, response.json()["id"], "ready")["id"]
    engine = registry.get(cache_id).engine
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, 30_000, size=40).astype(np.int32) for _ in range(2)]
    for tokens in seqs:
        kv = torch.randn(2, 2, len(tokens), 2, 8, dtype=torch.float16, generator=torch.Generator().manual_seed(seed))
        assert engine.put(tokens, kv).num_cached_tokens == len(tokens)
    return cache_id, {bytes(t.tobytes()): engine.get(t)[1].clone() for t in seqs}


def assert_moved(cache_id, kv_by_tokens, fleet, epoch_from):
    source_registry, target_registry = fleet[SOURCE][0], fleet[TARGET][0]
    cache = Cache.objects.get(pk=cache_id)
    assert (cache.node_id, cache.endpoint, cache.epoch) == (TARGET, ENDPOINTS[TARGET], epoch_from + 1)
    hosted = target_registry.get(cache_id)
    assert hosted is not None and hosted.epoch == epoch_from + 1
    for raw, kv in kv_by_tokens.items():
        tokens = np.frombuffer(raw, dtype=np.int32)
        n, got = hosted.engine.get(tokens)
        assert n == len(tokens) and torch.equal(got, kv)  # bit-exact on the target
    assert eventually(lambda: source_registry.get(cache_id) is None)  # the source let it go
    with pytest.raises(MovedError) as moved:
        fences_for(source_registry).check(cache_id, write=False)
    assert (moved.value.endpoint, moved.value.epoch) == (ENDPOINTS[TARGET], epoch_from + 1)
    assert AuditEvent.objects.filter(action=AuditAction.CACHE_MIGRATED, target_id=str(cache_id)).count() == 1


def test_migrate_one_cache_bit_exact_with_epoch_flip(tenant_a, fleet):
    cache_id, kv = ready_cache_with_data(tenant_a, fleet[SOURCE][0], "mig-one", 1)
    before = reserved(Node.objects.get(pk=SOURCE))
    migration = migration_start(cache_id=cache_id, target_node_id=TARGET, reason="rebalance")
    assert eventually(lambda: Migration.objects.get(pk=migration.pk).state == "complete", timeout=30)
    row = Migration.objects.get(pk=migration.pk)
    assert row.blocks_copied == len(bt.snapshot(fleet[TARGET][0].get(cache_id).engine)) > 0
    assert_moved(cache_id, kv, fleet, epoch_from=1)
    assert reserved(Node.objects.get(pk=SOURCE))["device"] == before["device"] - 8 * BLOCK_BYTES
    assert reserved(Node.objects.get(pk=TARGET))["device"] == 8 * BLOCK_BYTES
    token = tenant_a.client.post(f"/api/v1/caches/{cache_id}/tokens", {"access": "readwrite"}, format="json").json()
    assert token["epoch"] == 2 and token["endpoint"] == ENDPOINTS[TARGET]  # tokens follow the new placement


def test_drain_moves_every_cache_off_and_cordons(tenant_a, tenant_b, fleet, staff_client):
    moved = [
        ready_cache_with_data(tenant, fleet[SOURCE][0], f"drain-{i}", 10 + i)
        for i, tenant in enumerate((tenant_a, tenant_b))
    ]
    response = staff_client.post(f"/api/v1/admin/nodes/{SOURCE}/drain")
    assert response.status_code == 200, response.content
    assert len(response.json()["migrations"]) == 2
    assert eventually(lambda: not Cache.objects.filter(node_id=SOURCE, state="ready").exists(), timeout=40)
    for cache_id, kv in moved:
        assert_moved(cache_id, kv, fleet, epoch_from=1)
    assert Node.objects.get(pk=SOURCE).state == NodeState.DRAINING  # no new placements
    assert AuditEvent.objects.filter(action=AuditAction.NODE_DRAINING, target_id=str(SOURCE)).count() == 1
    again = tenant_a.client.post("/api/v1/caches", attach_body("after-drain", device=8 * BLOCK_BYTES), format="json")
    assert Cache.objects.get(pk=again.json()["id"]).node_id == TARGET
    # settle before the test's database is flushed: every answer the nodes owe has landed (a provisioning answer
    # arriving during the flush deadlocked with its TRUNCATE)
    wait_for_state(tenant_a.client, again.json()["id"], "ready")
    assert eventually(
        lambda: not NodeOrder.objects.filter(state__in=OPEN_ORDER_STATES, expects_answer=True).exists(), timeout=30
    )


def test_drain_is_staff_only(tenant_a, fleet):
    assert tenant_a.client.post(f"/api/v1/admin/nodes/{SOURCE}/drain").status_code in (401, 403)
    assert Node.objects.get(pk=SOURCE).state == NodeState.READY
