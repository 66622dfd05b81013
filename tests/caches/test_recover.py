"""POST /api/v1/caches/{id}/recover: a cache whose node was lost comes back on another node from its network tier
(new epoch, the provisioning order through the outbox, audited); anything else is a 409 naming why; tenant-scoped."""

import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from audit.actions import AuditAction
from audit.models import AuditEvent
from caches import services
from caches.models import Cache, CacheState
from fleet.models import Node, NodeOrder, OrderState
from kcaas.node_protocol.messages import PROVISION_TASK
from tests.caches.conftest import BLOCK_BYTES, SPEC, make_ready, purge_node_queue, reserved

pytestmark = pytest.mark.django_db

URL = "/api/v1/caches"
DEVICE = 4 * BLOCK_BYTES
NOTHING = {"device": 0, "dram": 0, "ssd": 0}


@pytest.fixture(autouse=True)
def store(settings):
    settings.KCAAS_NETWORK_STORE_BYTES = 100 * BLOCK_BYTES


@pytest.fixture
def two_nodes(make_node):
    """(the node caches are placed on first: the tighter fit, the spare one)."""
    first, spare = make_node(device=8 * BLOCK_BYTES), make_node(device=64 * BLOCK_BYTES)
    yield first, spare
    for node in Node.objects.all():
        purge_node_queue(node.pk)


def _attach(handle, name="r1", *, network=8 * BLOCK_BYTES, write_through=False) -> Cache:
    capacity = {"device": DEVICE, "network": network}
    made = {"name": name, "spec": SPEC, "capacity": capacity, "network_write_through": write_through}
    response = handle.client.post(URL, made, format="json")
    assert response.status_code == 201, response.content
    return make_ready(response.json()["id"])


def _lose(node) -> None:
    """The node's lease runs out and the sweep marks it lost: its caches fail with node_lost."""
    Node.objects.filter(pk=node.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    services.caches_sweep_leases()


def _recover(handle, cache_id):
    return handle.client.post(f"{URL}/{cache_id}/recover", {}, format="json")


def _error(response, status, code) -> dict:
    assert response.status_code == status, response.content
    assert response.json()["error"]["code"] == code, response.content
    return response.json()["error"]


def test_a_node_lost_cache_is_placed_on_another_node_at_a_new_epoch(tenant_a, two_nodes):
    first, spare = two_nodes
    cache = _attach(tenant_a, write_through=True)
    assert cache.node_id == first.pk
    _lose(first)
    cache.refresh_from_db()
    assert (cache.state, cache.failure_reason) == (CacheState.FAILED, "node_lost")

    response = _recover(tenant_a, cache.pk)
    assert response.status_code == 202, response.content
    shown = response.json()
    assert (shown["state"], shown["node_id"], shown["epoch"]) == ("provisioning", str(spare.pk), 2)
    assert shown["failure_reason"] == "" and shown["endpoint"] == ""
    assert shown["capacity"]["network"] == 8 * BLOCK_BYTES and shown["network_write_through"] is True
    assert reserved(spare) == {"device": DEVICE, "dram": 0, "ssd": 0} and reserved(first) == NOTHING
    (order,) = NodeOrder.objects.filter(node=spare, task=PROVISION_TASK, state__in=[OrderState.PENDING])
    assert order.args == [str(cache.pk), 2]  # the builder's ids: keys are unsealed at send time
    message = services.provision_order_message(str(cache.pk), 2)
    assert message is not None and message.epoch == 2 and message.network_write_through is True
    (event,) = AuditEvent.objects.filter(action=AuditAction.CACHE_RECOVERED)
    assert event.target_id == str(cache.pk) and event.tenant_id == tenant_a.tenant.pk
    assert event.old_values["state"] == "failed" and event.old_values["node_id"] == str(first.pk)
    assert event.new_values["epoch"] == 2 and event.new_values["node_id"] == str(spare.pk)
    assert make_ready(cache.pk).state == CacheState.READY  # the new node's answer finishes it, as after an attach
    _error(_recover(tenant_a, cache.pk), 409, "cache_not_node_lost")  # once recovered, nothing more to do


def test_only_a_node_lost_cache_is_recovered(tenant_a, two_nodes):
    cache = _attach(tenant_a)
    error = _error(_recover(tenant_a, cache.pk), 409, "cache_not_node_lost")
    assert error["details"] == {"state": "ready", "failure_reason": ""}
    Cache.objects.filter(pk=cache.pk).update(state=CacheState.FAILED, failure_reason="provisioning_timeout")
    _error(_recover(tenant_a, cache.pk), 409, "cache_not_node_lost")
    Cache.objects.filter(pk=cache.pk).update(state=CacheState.DETACHED, failure_reason="node_lost")
    _error(_recover(tenant_a, cache.pk), 409, "cache_not_node_lost")
    assert not AuditEvent.objects.filter(action=AuditAction.CACHE_RECOVERED).exists()


def test_a_cache_without_a_network_tier_has_nothing_to_recover_from(tenant_a, two_nodes):
    cache = _attach(tenant_a, network=0)
    _lose(two_nodes[0])
    error = _error(_recover(tenant_a, cache.pk), 409, "cache_without_network_tier")
    assert error["details"]["capacity"]["network"] == 0
    cache.refresh_from_db()
    assert (cache.state, cache.node_id, cache.epoch) == (CacheState.FAILED, two_nodes[0].pk, 1)


def test_a_fleet_without_its_network_store_is_409_network_tier_absent(tenant_a, two_nodes, settings):
    cache = _attach(tenant_a)
    _lose(two_nodes[0])
    settings.KCAAS_NETWORK_STORE_BYTES = 0
    _error(_recover(tenant_a, cache.pk), 409, "network_tier_absent")


def test_no_node_with_room_is_503_and_the_cache_stays_node_lost(tenant_a, make_node):
    only = make_node(device=8 * BLOCK_BYTES)
    cache = _attach(tenant_a)
    _lose(only)
    _error(_recover(tenant_a, cache.pk), 503, "no_capacity")
    cache.refresh_from_db()
    assert (cache.state, cache.failure_reason, cache.epoch) == (CacheState.FAILED, "node_lost", 1)
    spare = make_node(device=8 * BLOCK_BYTES)
    assert _recover(tenant_a, cache.pk).json()["node_id"] == str(spare.pk)  # a node came: it can now
    purge_node_queue(spare.pk)


def test_another_tenants_cache_is_404_and_left_alone(tenant_a, tenant_b, two_nodes):
    cache = _attach(tenant_a)
    _lose(two_nodes[0])
    _error(_recover(tenant_b, cache.pk), 404, "not_found")
    _error(_recover(tenant_b, uuid.uuid4()), 404, "not_found")
    cache.refresh_from_db()
    assert (cache.state, cache.epoch) == (CacheState.FAILED, 1)
    assert _recover(tenant_a, cache.pk).status_code == 202


def test_recover_needs_caches_write_and_staff_may_recover_any_tenants(tenant_a, two_nodes, staff_client):
    cache = _attach(tenant_a)
    _lose(two_nodes[0])
    _error(tenant_a.key("caches:read").post(f"{URL}/{cache.pk}/recover", {}, format="json"), 403, "permission_denied")
    assert staff_client.post(f"{URL}/{cache.pk}/recover", {}, format="json").status_code == 202


def test_a_suspended_tenants_cache_is_not_recovered_even_by_staff(tenant_a, two_nodes, staff_client):
    from tenants import services as tenant_services

    cache = _attach(tenant_a)
    _lose(two_nodes[0])
    tenant_services.tenant_set_status(tenant=tenant_a.tenant, status="suspended")
    _error(staff_client.post(f"{URL}/{cache.pk}/recover", {}, format="json"), 409, "tenant_inactive")
    cache.refresh_from_db()
    assert (cache.state, cache.epoch) == (CacheState.FAILED, 1)
