"""The node's answers (status guards), detach, and the lease sweep flagging caches of lost nodes."""

from datetime import timedelta

import pytest
from django.utils import timezone

from caches import services, tasks
from caches.models import Cache, CacheState
from fleet.models import NodeState
from kcaas.node_protocol.messages import DetachResult, ProvisionResult
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
    _provision_answer(str(cache.pk), str(wrong.pk), True, "", "1.2.3.4:1")
    assert _state(cache) == CacheState.PROVISIONING  # a message from another node changes nothing
    _provision_answer(str(cache.pk), str(cache.node_id), True, "", "10.9.9.9:7000")
    assert _state(cache) == CacheState.READY and cache.endpoint == "10.9.9.9:7000"
    # Duplicate and stale deliveries are no-ops.
    _provision_answer(str(cache.pk), str(cache.node_id), False, "late failure", "")
    assert _state(cache) == CacheState.READY and cache.failure_reason == ""
    assert reserved(cache.node)["device"] == DEVICE


def _provision_answer(cache_id, node_id, ok, reason, endpoint):
    answer = ProvisionResult(cache_id=cache_id, node_id=node_id, ok=ok, reason=reason, endpoint=endpoint)
    return tasks.provision_result.apply(kwargs=answer.to_dict()).get()


def _detach_answer(cache_id, node_id):
    return tasks.detach_result.apply(kwargs=DetachResult(cache_id=cache_id, node_id=node_id).to_dict()).get()


def test_unknown_or_malformed_ids_are_ignored(db):
    assert _provision_answer("00000000-0000-0000-0000-000000000000", "x", True, "", "x:1") is None
    assert _detach_answer("not-a-uuid", "x") is None


def test_malformed_answers_change_nothing_and_are_not_retried(tenant_a, node):
    """Positional arguments, a missing, unknown or mistyped field, another version: dropped, the cache unchanged."""
    cache = _attach(tenant_a)
    good = ProvisionResult(cache_id=str(cache.pk), node_id=str(node.pk), ok=True, reason="", endpoint="x:1").to_dict()
    malformed = [
        ((str(cache.pk), str(node.pk), True, "", "x:1"), {}),
        ((), {k: v for k, v in good.items() if k != "endpoint"}),
        ((), {**good, "extra": 1}),
        ((), {**good, "ok": "yes"}),
        ((), {**good, "v": 2}),
    ]
    for args, kwargs in malformed:
        outcome = tasks.provision_result.apply(args=args, kwargs=kwargs)
        assert outcome.successful() and outcome.get() is None, (args, kwargs)
        assert _state(cache) == CacheState.PROVISIONING
    assert tasks.provision_result.apply(kwargs=good).get() == CacheState.READY


def test_failed_provisioning_keeps_the_reason_and_releases_the_reservation(tenant_a, node):
    cache = _attach(tenant_a)
    assert reserved(node)["device"] == DEVICE
    _provision_answer(str(cache.pk), str(node.pk), False, "cuda out of memory", "")
    assert _state(cache) == CacheState.FAILED and cache.failure_reason == "cuda out of memory"
    assert reserved(node) == NOTHING
    _provision_answer(str(cache.pk), str(node.pk), False, "cuda out of memory", "")
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
    _provision_answer(str(cache.pk), str(node.pk), True, "", "x:1")
    assert _state(cache) == CacheState.DETACHING  # a late provisioning answer does not resurrect it
    _detach_answer(str(cache.pk), str(node.pk))
    assert _state(cache) == CacheState.DETACHED and reserved(node) == NOTHING
    _detach_answer(str(cache.pk), str(node.pk))
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
