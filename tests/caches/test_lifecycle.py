"""The node's answers (status guards), detach, and the lease sweep flagging caches of lost nodes."""

from datetime import timedelta

import pytest
from django.utils import timezone

from caches import services, tasks
from caches.models import Cache, CacheState
from fleet.models import NodeState
from tests.caches.conftest import BLOCK_BYTES, attach_body, make_ready, reserved

pytestmark = pytest.mark.django_db

DEVICE = 64 * BLOCK_BYTES
NOTHING = {"device": 0, "dram": 0, "ssd": 0}


def _attach(handle, name="c1") -> Cache:
    response = handle.client.post("/api/v1/caches", attach_body(name=name, device=DEVICE), format="json")
    assert response.status_code == 201, response.content
    return Cache.objects.get(pk=response.json()["id"])


def _state(cache) -> str:
    cache.refresh_from_db()
    return cache.state


def test_ready_only_from_provisioning_and_from_its_own_node(tenant_a, make_node):
    node, other = make_node(), make_node()
    cache = _attach(tenant_a)
    assert cache.node_id == node.pk or cache.node_id == other.pk
    wrong = other if cache.node_id == node.pk else node
    tasks.provision_result.apply(args=[str(cache.pk), str(wrong.pk), True, "", "1.2.3.4:1"])
    assert _state(cache) == CacheState.PROVISIONING  # a message from another node changes nothing
    tasks.provision_result.apply(args=[str(cache.pk), str(cache.node_id), True, "", "10.9.9.9:7000"])
    assert _state(cache) == CacheState.READY and cache.endpoint == "10.9.9.9:7000"
    # Duplicate and stale deliveries are no-ops.
    tasks.provision_result.apply(args=[str(cache.pk), str(cache.node_id), False, "late failure", ""])
    assert _state(cache) == CacheState.READY and cache.failure_reason == ""
    assert reserved(cache.node)["device"] == DEVICE


def test_unknown_or_malformed_ids_are_ignored(db):
    assert tasks.provision_result.apply(args=["00000000-0000-0000-0000-000000000000", "x", True]).get() is None
    assert tasks.detach_result.apply(args=["not-a-uuid", "x"]).get() is None


def test_failed_provisioning_keeps_the_reason_and_releases_the_reservation(tenant_a, node):
    cache = _attach(tenant_a)
    assert reserved(node)["device"] == DEVICE
    tasks.provision_result.apply(args=[str(cache.pk), str(node.pk), False, "cuda out of memory", ""])
    assert _state(cache) == CacheState.FAILED and cache.failure_reason == "cuda out of memory"
    assert reserved(node) == NOTHING
    tasks.provision_result.apply(args=[str(cache.pk), str(node.pk), False, "cuda out of memory", ""])
    assert reserved(node) == NOTHING  # released once
    # Detaching a failed cache finishes at once (it holds nothing) and is idempotent.
    response = tenant_a.client.delete(f"/api/v1/caches/{cache.pk}")
    assert response.status_code == 200 and response.json()["state"] == "detached"
    assert tenant_a.client.delete(f"/api/v1/caches/{cache.pk}").json()["state"] == "detached"
    assert reserved(node) == NOTHING


def test_detach_then_node_confirms(tenant_a, node, django_capture_on_commit_callbacks):
    cache = make_ready(_attach(tenant_a).pk)
    with django_capture_on_commit_callbacks() as callbacks:
        response = tenant_a.client.delete(f"/api/v1/caches/{cache.pk}")
    assert response.status_code == 202 and response.json()["state"] == "detaching"
    assert len(callbacks) == 1  # kcaas.node.detach_cache, sent on commit
    again = tenant_a.client.delete(f"/api/v1/caches/{cache.pk}")
    assert again.status_code == 202 and again.json()["state"] == "detaching"
    assert reserved(node)["device"] == DEVICE  # held until the node confirms
    tasks.provision_result.apply(args=[str(cache.pk), str(node.pk), True, "", "x:1"])
    assert _state(cache) == CacheState.DETACHING  # a late provisioning answer does not resurrect it
    tasks.detach_result.apply(args=[str(cache.pk), str(node.pk)])
    assert _state(cache) == CacheState.DETACHED and reserved(node) == NOTHING
    tasks.detach_result.apply(args=[str(cache.pk), str(node.pk)])
    assert reserved(node) == NOTHING
    final = tenant_a.client.delete(f"/api/v1/caches/{cache.pk}")
    assert final.status_code == 200 and final.json()["state"] == "detached"


def test_sweep_flags_caches_of_lost_nodes(tenant_a, make_node):
    doomed = make_node()
    ready, provisioning, detaching = (_attach(tenant_a, f"d{i}") for i in range(3))
    healthy = make_node(device=2 * DEVICE)  # the best fit (least room left) for the next cache
    spared = _attach(tenant_a, "h")
    assert spared.node_id == healthy.pk
    make_ready(ready.pk)
    Cache.objects.filter(pk=detaching.pk).update(state=CacheState.DETACHING)
    type(doomed).objects.filter(pk=doomed.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))

    assert tasks.sweep_leases.apply().get() == 3
    doomed.refresh_from_db()
    assert doomed.state == NodeState.LOST
    for cache in (ready, provisioning):
        cache.refresh_from_db()
        assert (cache.state, cache.failure_reason) == (CacheState.FAILED, "node_lost")
    assert _state(detaching) == CacheState.DETACHED
    assert reserved(doomed) == NOTHING
    assert _state(spared) == CacheState.PROVISIONING
    assert tasks.sweep_leases.apply().get() == 0  # idempotent


def test_sweep_catches_nodes_marked_lost_elsewhere(tenant_a, node):
    cache = make_ready(_attach(tenant_a).pk)
    type(node).objects.filter(pk=node.pk).update(state=NodeState.LOST)  # e.g. by a fleet-side sweep
    assert services.caches_sweep_leases() == [cache.pk]
    assert _state(cache) == CacheState.FAILED
