"""Erasure across the fleet, through TWO real node task consumers (gpu_node.agent.tasks.build_node_app over a real
CacheRegistry) and the control plane's own worker, over the real broker:
- after the erasure no block of the tenant remains on any node: its pools are zeroed and gone from both registries,
  its data tokens reached the nodes' revocation lists, while another tenant's cache on the same node still serves;
- the receipt lists each node's confirmation and the bytes it freed, and verifies; the trail holds no trace;
- a node that is down while the erasure runs keeps the job running; it is purged when it registers again (its
  consumer started only afterwards), and only then does the job complete."""

import os
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
import torch
from django.conf import settings
from django.utils import timezone
from rest_framework.test import APIClient

from caches.services import caches_sweep_leases
from core.celery import app as control_app
from fleet import services as fleet_services
from fleet.models import Node
from gpu_node.agent.registry import CacheRegistry
from gpu_node.agent.tasks import build_node_app
from gpu_node.dataplane.tokens import RevocationList
from gpu_node.engine.block_hash import tokens_as_int32
from gpu_node.engine.cache_state import CachePurged
from kcaas.node_protocol.messages import node_queue
from privacy import receipt as receipts
from privacy import services
from tests.caches.conftest import BLOCK_BYTES, attach_body, purge_node_queue, wait_for_state
from tests.fleet.node_keys import TEST_SEALING_KEY, TEST_SEALING_PUBLIC_KEY
from tests.privacy.conftest import audit_chain_problems, audit_rows_mentioning, running_workers
from tests.waiting import eventually

pytestmark = pytest.mark.django_db(transaction=True)

NODE_DEVICE_BYTES = 100 * BLOCK_BYTES
TOKENS = tokens_as_int32(list(range(20)))


@dataclass
class FakeHost:
    """One node as the control plane knows it, and the agent's state that outlives its task consumer (the registry
    stands for memory/SSD that a restarted agent finds again)."""

    node: Node
    credential: str
    endpoint: str
    registry: CacheRegistry = field(
        default_factory=lambda: CacheRegistry(device_capacity_bytes=NODE_DEVICE_BYTES, device="cpu")
    )
    revocations: RevocationList = field(default_factory=RevocationList)

    def consumer(self):
        node_app = build_node_app(
            broker_url=os.environ["CELERY_BROKER_URL"],
            node_id=str(self.node.pk),
            endpoint=self.endpoint,
            registry=self.registry,
            revocations=self.revocations,
            sealing_key=TEST_SEALING_KEY,
        )
        return node_app, [node_queue(self.node.pk)]

    def register(self) -> dict:
        agent = APIClient()
        agent.credentials(HTTP_AUTHORIZATION=f"Bearer {self.credential}")
        body = {
            "endpoint": self.endpoint,
            "capacity": {"device": NODE_DEVICE_BYTES, "dram": 0, "ssd": 0},
            "caches": self.registry.cache_ids(),
            "sealing_public_key": TEST_SEALING_PUBLIC_KEY,
        }
        response = agent.post("/api/v1/nodes/register", body, format="json")
        assert response.status_code == 200, response.content
        return response.json()


@pytest.fixture
def hosts(db):
    made = []
    for number in (1, 2):
        issued = fleet_services.node_create(name=f"erasure-node-{number}-{uuid.uuid4().hex[:6]}")
        host = FakeHost(node=issued.node, credential=issued.credential, endpoint=f"10.9.0.{number}:7070")
        host.register()
        made.append(host)
    yield made
    for host in made:
        purge_node_queue(host.node.pk)


@contextmanager
def workers(*hosts_running):
    with running_workers((control_app, ["control"]), *(host.consumer() for host in hosts_running)):
        yield


def attach_on(tenant, name: str, host: FakeHost, others: list[FakeHost]) -> str:
    """A ready cache of `tenant` placed on `host` (the other nodes cordoned meanwhile), holding 20 tokens of KV."""
    for other in others:
        fleet_services.node_cordon(node_id=other.node.pk)
    response = tenant.client.post("/api/v1/caches", attach_body(name, device=8 * BLOCK_BYTES), format="json")
    assert response.status_code == 201, response.content
    for other in others:
        fleet_services.node_uncordon(node_id=other.node.pk)
    cache_id = wait_for_state(tenant.client, response.json()["id"], "ready")["id"]
    hosted = host.registry.get(cache_id)
    assert hosted is not None, "the cache was placed on another node"
    hosted.engine.put(TOKENS, torch.randn(2, 2, 20, 2, 8).to(torch.float16))
    return cache_id


def erasure(staff_client, tenant_id) -> dict:
    return staff_client.get(f"/api/v1/admin/tenants/{tenant_id}/erasure").json()


def start_erasure(staff_client, tenant_id) -> None:
    assert staff_client.post(f"/api/v1/admin/tenants/{tenant_id}/erasure").status_code == 201
    services.erasures_run_due()


def assert_purged(host: FakeHost, engine, cache_id: str) -> None:
    assert host.registry.get(cache_id) is None
    assert not engine.pool.any()  # zeroed: nothing of the tenant's KV left in that memory
    with pytest.raises(CachePurged):  # a purged engine serves nothing more: an error, never a hit
        engine.lookup(TOKENS)


def test_erasure_purges_every_node_and_leaves_other_tenants_alone(staff_client, tenant_a, tenant_b, hosts, no_grace):
    one, two = hosts
    tenant_id, name = tenant_a.tenant.pk, tenant_a.tenant.name
    with workers(one, two):
        a1, a2 = attach_on(tenant_a, "a-one", one, [two]), attach_on(tenant_a, "a-two", two, [one])
        b1 = attach_on(tenant_b, "b-one", one, [two])
        engines = {a1: one.registry.get(a1).engine, a2: two.registry.get(a2).engine}
        token = tenant_a.client.post(f"/api/v1/caches/{a1}/tokens", {"access": "readwrite"}, format="json")
        assert token.status_code == 201
        jti = token.json()["jti"]

        start_erasure(staff_client, tenant_id)
        assert eventually(lambda: erasure(staff_client, tenant_id)["state"] == "complete"), erasure(
            staff_client, tenant_id
        )
        assert eventually(lambda: jti in one.revocations)  # the data token reached its node

    assert_purged(one, engines[a1], a1)
    assert_purged(two, engines[a2], a2)
    assert one.registry.get(b1).engine.lookup(TOKENS) == 20  # B's cache on the same node is untouched
    assert two.registry.cache_ids() == [] and one.registry.cache_ids() == [b1]
    refused = tenant_a.client.get("/api/v1/caches")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "api_key_revoked"
    assert tenant_b.client.get(f"/api/v1/caches/{b1}").json()["state"] == "ready"

    envelope = staff_client.get(f"/api/v1/admin/tenants/{tenant_id}/erasure/receipt").json()
    body = receipts.receipt_verify(envelope)
    per_node = {n["node_id"]: n for n in body["nodes"]}
    assert set(per_node) == {str(one.node.pk), str(two.node.pk)}
    assert [c["cache_id"] for c in per_node[str(one.node.pk)]["caches"]] == [a1]
    assert [c["cache_id"] for c in per_node[str(two.node.pk)]["caches"]] == [a2]
    assert all(n["freed_bytes"] > 0 for n in body["nodes"]) and body["bytes_freed"] == sum(
        n["freed_bytes"] for n in body["nodes"]
    )
    assert {c["cache_id"] for c in body["caches"]} == {a1, a2}
    assert audit_chain_problems() == []
    assert audit_rows_mentioning(str(tenant_id), name) == []
    one.node.refresh_from_db()
    assert one.node.device_reserved_bytes == 8 * BLOCK_BYTES  # only B's reservation is left


def test_a_node_down_during_the_erasure_is_purged_when_it_registers_again(staff_client, tenant_a, hosts, no_grace):
    one, two = hosts
    tenant_id = tenant_a.tenant.pk
    with workers(one, two):
        a1, a2 = attach_on(tenant_a, "a-one", one, [two]), attach_on(tenant_a, "a-two", two, [one])
    engines = {a1: one.registry.get(a1).engine, a2: two.registry.get(a2).engine}
    Node.objects.filter(pk=two.node.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))  # two is down
    caches_sweep_leases()
    assert Node.objects.get(pk=two.node.pk).state == "lost"

    with workers(one):
        start_erasure(staff_client, tenant_id)
        assert eventually(
            lambda: [p["state"] for p in erasure(staff_client, tenant_id)["purges"]].count("confirmed") == 1
        )
        # Instead of waiting: the beat's dispatcher runs again, here and now, at a time past the resend interval,
        # and a finish arrives (as the one a confirmation enqueues); neither may complete the job nor send to two.
        resend_due = timezone.now() + timedelta(seconds=settings.KCAAS_ERASURE_RESEND_SECONDS + 1)
        assert services.erasures_run_due(now=resend_due) == []  # it moved no job
        assert services.erasure_finish_guarded(job_id=erasure(staff_client, tenant_id)["id"]).state == "running"
        job = erasure(staff_client, tenant_id)
        assert job["state"] == "running"  # still waiting for node two
        pending = [p for p in job["purges"] if p["state"] == "pending"]
        assert [p["node_id"] for p in pending] == [str(two.node.pk)] and pending[0]["send_count"] == 0
    assert_purged(one, engines[a1], a1)
    assert two.registry.get(a2) is not None and two.registry.get(a2).engine.lookup(TOKENS) == 20  # still there

    registration = two.register()  # node two comes back (its agent found its old data)
    assert registration["caches"] == []  # the erased tenant's cache is not provisioned again
    with workers(one, two):
        assert eventually(lambda: erasure(staff_client, tenant_id)["state"] == "complete"), erasure(
            staff_client, tenant_id
        )
    assert_purged(two, engines[a2], a2)
    body = receipts.receipt_verify(staff_client.get(f"/api/v1/admin/tenants/{tenant_id}/erasure/receipt").json())
    assert {n["node_id"]: [c["cache_id"] for c in n["caches"]] for n in body["nodes"]} == {
        str(one.node.pk): [a1],
        str(two.node.pk): [a2],
    }
