"""End to end over the real broker: attach -> provisioning -> ready -> detach -> detached, and a failed provisioning,
with two real Celery workers in threads: the control plane's on `control` and a minimal node agent
(tests/caches/node_consumer.py, its own Celery app, no Django) on `node.<id>`."""

import uuid

import pytest

from caches.models import Cache
from caches.sealing import hash_key_unseal
from kcaas.node_protocol.messages import PROVISION_TASK
from tests.caches import node_consumer
from tests.caches.conftest import SPEC, attach_body, reserved, wait_for_state
from tests.fleet.node_keys import opened
from tests.waiting import eventually

pytestmark = pytest.mark.django_db(transaction=True)

NOTHING = {"device": 0, "dram": 0, "ssd": 0}


# The workers outlive each test (starting and stopping a pair costs seconds), so the node they serve keeps one id:
# every test registers its node under it (the database is emptied between transactional tests).
NODE_ID = uuid.UUID("6e0de000-0000-4000-8000-00000000cafe")


@pytest.fixture(scope="module")
def workers():
    yield from node_consumer.module_workers(NODE_ID)


@pytest.fixture
def node(make_node, workers):
    """A registered node with the id the node worker serves; the consumer told who it is and to succeed."""
    yield node_consumer.adopt_node(make_node(), NODE_ID)
    assert eventually(lambda: node_consumer.workers_settled(NODE_ID), timeout=20), "the workers did not settle"


def test_attach_provision_ready_then_detach(tenant_a, node, workers):
    response = tenant_a.client.post("/api/v1/caches", attach_body(), format="json")
    assert response.status_code == 201 and response.json()["state"] == "provisioning"
    cache_id = response.json()["id"]

    ready = wait_for_state(tenant_a.client, cache_id, "ready")
    assert ready["endpoint"] == node.endpoint and ready["node_id"] == str(node.pk)
    ((name, (sent_id, spec, capacity, hash_key_box, epoch, tenant_id, _, write_through)),) = workers.received
    cache = Cache.objects.get(pk=cache_id)
    assert (name, sent_id, spec, epoch, tenant_id) == ("provision_cache", cache_id, SPEC, 1, str(cache.tenant_id))
    assert write_through is False
    assert capacity == cache.capacity()
    assert opened(hash_key_box, task=PROVISION_TASK, node_id=node.pk, cache_id=cache_id) == hash_key_unseal(
        cache_id=cache.pk, sealed=cache.hash_key_sealed
    )
    assert tenant_a.client.post(f"/api/v1/caches/{cache_id}/tokens", {}, format="json").status_code == 201

    detaching = tenant_a.client.delete(f"/api/v1/caches/{cache_id}")
    assert detaching.status_code == 202 and detaching.json()["state"] == "detaching"
    wait_for_state(tenant_a.client, cache_id, "detached")
    assert workers.received[-1] == ("detach_cache", [cache_id, 1, True])  # a tenant's detach: forget_network
    assert reserved(node) == NOTHING


def test_failed_provisioning_reports_the_nodes_reason(tenant_a, node, workers):
    workers.fail_reason = "not enough device memory"
    response = tenant_a.client.post("/api/v1/caches", attach_body(), format="json")
    assert response.status_code == 201
    failed = wait_for_state(tenant_a.client, response.json()["id"], "failed")
    assert failed["failure_reason"] == "not enough device memory" and failed["endpoint"] == ""
    assert reserved(node) == NOTHING
