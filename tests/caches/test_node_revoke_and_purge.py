"""Token revocation and tenant purge through the real node tasks (gpu_node/agent/tasks.py) over the real broker:
- revoking a data token (one jti, or every token of a cache) over the REST API pushes it to the cache's node, whose
  RevocationList (what its data plane's TokenVerifier reads) then refuses it; the node's heartbeat and register
  answers list it too, so a node that missed the push or restarted refuses it as well;
- purge_tenant drops every cache of one tenant on the node, zeroes their pools, and leaves other tenants alone."""

import os
import uuid

import pytest
import torch
from rest_framework.test import APIClient

from core.celery import app as control_app
from fleet.credentials import credential_new
from fleet.models import Node
from gpu_node.agent.registry import CacheRegistry
from gpu_node.agent.tasks import build_node_app
from gpu_node.dataplane.tokens import RevocationList
from gpu_node.engine.block_hash import tokens_as_int32
from gpu_node.engine.cache_state import CachePurged
from kcaas.node_protocol.messages import PURGE_TENANT_TASK, PurgeTenant, node_queue
from tests.caches.conftest import BLOCK_BYTES, attach_body, purge_node_queue, running_workers, wait_for_state
from tests.fleet.node_keys import TEST_SEALING_KEY, TEST_SEALING_PUBLIC_KEY
from tests.waiting import eventually

pytestmark = pytest.mark.django_db(transaction=True)

NODE_ID = uuid.UUID("6e0de000-0000-4000-8000-00000000f0e7")
ENDPOINT = "10.7.0.2:7070"
NODE_DEVICE_BYTES = 100 * BLOCK_BYTES


@pytest.fixture(scope="module")
def node_side():
    registry = CacheRegistry(device_capacity_bytes=NODE_DEVICE_BYTES, device="cpu")
    revocations = RevocationList()
    node_app = build_node_app(
        broker_url=os.environ["CELERY_BROKER_URL"],
        node_id=str(NODE_ID),
        endpoint=ENDPOINT,
        registry=registry,
        revocations=revocations,
        sealing_key=TEST_SEALING_KEY,
    )
    try:
        with running_workers((control_app, ["control"]), (node_app, [node_queue(NODE_ID)])):
            yield registry, revocations
    finally:
        purge_node_queue(NODE_ID)


@pytest.fixture
def node(make_node, node_side):
    made = make_node(device=NODE_DEVICE_BYTES)
    Node.objects.filter(pk=made.pk).update(id=NODE_ID, endpoint=ENDPOINT)
    return Node.objects.get(pk=NODE_ID)


def ready_cache(tenant, name: str) -> str:
    response = tenant.client.post("/api/v1/caches", attach_body(name, device=8 * BLOCK_BYTES), format="json")
    assert response.status_code == 201, response.content
    return wait_for_state(tenant.client, response.json()["id"], "ready")["id"]


def issue(tenant, cache_id: str) -> str:
    response = tenant.client.post(f"/api/v1/caches/{cache_id}/tokens", {"access": "readwrite"}, format="json")
    assert response.status_code == 201, response.content
    return response.json()["jti"]


def test_revoked_tokens_reach_the_node_and_its_heartbeat_answers(tenant_a, tenant_b, node, node_side):
    _, revocations = node_side
    cache_id = ready_cache(tenant_a, "revoke-one")
    kept, revoked = issue(tenant_a, cache_id), issue(tenant_a, cache_id)

    answer = tenant_a.client.post(f"/api/v1/caches/{cache_id}/tokens/{revoked}/revoke")
    assert answer.status_code == 200 and answer.json() == {"revoked": 1}
    assert eventually(lambda: revoked in revocations)
    assert kept not in revocations
    again = tenant_a.client.post(f"/api/v1/caches/{cache_id}/tokens/{revoked}/revoke")
    assert again.status_code == 200 and again.json() == {"revoked": 0}  # idempotent

    # another tenant cannot revoke (nor learn about) A's tokens; an unknown jti is a 404 too
    foreign = tenant_b.client.post(f"/api/v1/caches/{cache_id}/tokens/{kept}/revoke")
    missing = tenant_a.client.post(f"/api/v1/caches/{cache_id}/tokens/{uuid.uuid4()}/revoke")
    assert foreign.status_code == missing.status_code == 404
    assert foreign.json()["error"]["code"] == "not_found"
    read_only = tenant_a.key("caches:read").post(f"/api/v1/caches/{cache_id}/tokens/{kept}/revoke")
    assert read_only.status_code == 403 and read_only.json()["error"]["details"]["required_scope"] == "caches:write"

    everything = tenant_a.client.post(f"/api/v1/caches/{cache_id}/tokens/revoke")
    assert everything.status_code == 200 and everything.json() == {"revoked": 1}
    assert eventually(lambda: kept in revocations)

    # the node's own calls carry the list: a restarted agent (an empty RevocationList) learns both at register
    credential = credential_new()
    Node.objects.filter(pk=NODE_ID).update(
        credential_public_id=credential.public_id, credential_hash=credential.secret_hash
    )
    agent = APIClient()
    agent.credentials(HTTP_AUTHORIZATION=f"Bearer {credential.raw}")
    body = {
        "endpoint": ENDPOINT,
        "capacity": {"device": NODE_DEVICE_BYTES, "dram": 0, "ssd": 0},
        "sealing_public_key": TEST_SEALING_PUBLIC_KEY,
    }
    registered = agent.post("/api/v1/nodes/register", {**body, "caches": [cache_id]}, format="json")
    assert registered.status_code == 200, registered.content
    fresh = RevocationList()
    assert fresh.update(registered.json()["revoked_tokens"]) == 2 and kept in fresh and revoked in fresh
    heartbeat = agent.post("/api/v1/nodes/heartbeat", body, format="json")
    assert {entry["jti"] for entry in heartbeat.json()["revoked_tokens"]} == {kept, revoked}


def test_purge_tenant_drops_and_zeroes_only_that_tenants_caches(tenant_a, tenant_b, node, node_side):
    registry, _ = node_side
    a1, a2, b1 = ready_cache(tenant_a, "purge-a1"), ready_cache(tenant_a, "purge-a2"), ready_cache(tenant_b, "keep-b")
    tokens = tokens_as_int32(list(range(20)))
    kv = torch.randn(2, 2, 20, 2, 8).to(torch.float16)
    engines = {cache_id: registry.get(cache_id).engine for cache_id in (a1, a2, b1)}
    for engine in engines.values():
        engine.put(tokens, kv)
    tenant_id = str(tenant_a.tenant.pk)

    purge = PurgeTenant(tenant_id=tenant_id, job_id="job-1")
    control_app.send_task(PURGE_TENANT_TASK, kwargs=purge.to_dict(), queue=node_queue(NODE_ID))
    assert eventually(lambda: registry.get(a1) is None and registry.get(a2) is None)
    for cache_id in (a1, a2):
        assert not engines[cache_id].pool.any()  # nothing of A's KV left in that memory
        with pytest.raises(CachePurged):  # a purged engine serves nothing more: an error, never a hit
            engines[cache_id].lookup(tokens)
    assert registry.get(b1) is not None and registry.get(b1).engine.lookup(tokens) == 20  # B untouched
    assert registry.purge_tenant(tenant_id) == []  # a second purge finds nothing
