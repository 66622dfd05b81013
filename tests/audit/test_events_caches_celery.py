"""Issue 5 over the real broker: the node's provisioning and detach answers travel node agent -> `control` queue ->
the control plane's Celery worker, which records them as the node (actor node:<id>) with the cache's tenant, in the
transaction that changes the cache. Two real workers in threads, as in tests/caches/test_provisioning_integration.py:
the control plane's on `control`, a minimal node agent (tests/caches/node_consumer.py) on `node.<id>`."""

import time
import uuid

import pytest

from audit.actions import AuditAction
from audit.models import AuditEvent
from kcaas.node_protocol.messages import ProvisionResult
from tests.audit.events_support import (
    assert_event,
    events_since,
    make_node,  # noqa: F401 - fixture
    make_tenant,  # noqa: F401 - fixture
    mark,
)
from tests.caches import node_consumer
from tests.caches.conftest import attach_body, wait_for_state
from tests.waiting import eventually

pytestmark = pytest.mark.django_db(transaction=True)

# The workers outlive each test, so the node they serve keeps one id (its own, not the caches tests' node).
NODE_ID = uuid.UUID("6e0de000-0000-4000-8000-0000000a0d17")


@pytest.fixture(scope="module")
def workers():
    yield from node_consumer.module_workers(NODE_ID)


@pytest.fixture
def node(make_node, workers):
    yield node_consumer.adopt_node(make_node().node, NODE_ID)
    assert eventually(lambda: node_consumer.workers_settled(NODE_ID), timeout=20), "the workers did not settle"


def wait_for_event(action, target_id, timeout=20.0) -> AuditEvent:
    """The state the API shows and the event commit together; the event is read once it is there."""
    deadline = time.monotonic() + timeout
    while True:
        event = AuditEvent.objects.filter(action=int(action), target_id=str(target_id)).first()
        if event is not None:
            return event
        assert time.monotonic() < deadline, f"no {action.name} event for {target_id}"
        time.sleep(0.05)


def test_the_nodes_answers_through_the_broker_are_recorded_as_the_node(make_tenant, node, workers):
    handle = make_tenant()
    seq = mark()
    response = handle.client.post("/api/v1/caches", attach_body(), format="json")
    assert response.status_code == 201, response.content
    cache_id = response.json()["id"]
    wait_for_state(handle.client, cache_id, "ready")
    attached, ready = events_since(seq)
    assert attached.action == AuditAction.CACHE_ATTACHED and attached.request_id == response["X-Request-ID"]
    assert_event(
        ready,
        action=AuditAction.CACHE_READY,
        actor=("node", str(NODE_ID)),
        target_type="cache",
        target_id=cache_id,
        tenant_id=handle.tenant.pk,
        old={"state": "provisioning", "endpoint": ""},
        new={"state": "ready", "endpoint": node.endpoint},
    )  # (no request: a task)

    # A duplicate answer through the broker changes nothing and writes nothing.
    seq = mark()
    late = ProvisionResult(cache_id=cache_id, node_id=str(NODE_ID), ok=False, reason="late", endpoint="")
    node_consumer.node_app.send_task(late.TASK, kwargs=late.to_dict(), queue="control")
    detaching = handle.client.delete(f"/api/v1/caches/{cache_id}")
    assert detaching.status_code == 202
    wait_for_state(handle.client, cache_id, "detached")
    detached = wait_for_event(AuditAction.CACHE_DETACHED, cache_id)
    assert_event(
        detached,
        action=AuditAction.CACHE_DETACHED,
        actor=("node", str(NODE_ID)),
        target_type="cache",
        target_id=cache_id,
        tenant_id=handle.tenant.pk,
        old={"state": "detaching"},
        new={"state": "detached"},
    )
    # Whenever the control worker ran the duplicate, the cache was not provisioning any more: no event for it.
    assert [e.action for e in events_since(seq)] == [AuditAction.CACHE_DETACH_REQUESTED, AuditAction.CACHE_DETACHED]


def test_a_failed_provisioning_through_the_broker_is_recorded_with_the_nodes_reason(make_tenant, node, workers):
    handle = make_tenant()
    workers.fail_reason = "not enough device memory"
    response = handle.client.post("/api/v1/caches", attach_body(), format="json")
    assert response.status_code == 201
    cache_id = response.json()["id"]
    wait_for_state(handle.client, cache_id, "failed")
    assert_event(
        wait_for_event(AuditAction.CACHE_FAILED, cache_id),
        action=AuditAction.CACHE_FAILED,
        actor=("node", str(NODE_ID)),
        target_type="cache",
        target_id=cache_id,
        tenant_id=handle.tenant.pk,
        old={"state": "provisioning", "failure_reason": ""},
        new={"state": "failed", "failure_reason": "not enough device memory"},
    )
