"""The reconciler ends every provisioning and detach in bounded time (caches.reconcile): a cache whose node never
answers is failed (`provisioning_timeout`) or detached (`detach_unconfirmed`) after its deadline, its reservation
released; younger ones are left alone, and a node answer that arrives afterwards changes nothing."""

from datetime import timedelta

import pytest
from django.utils import timezone

from audit.actions import AuditAction
from audit.models import AuditEvent
from caches import services
from caches.models import Cache, CacheState
from caches.reconcile import caches_reconcile_stuck
from fleet.models import NodeOrder, OrderState
from kcaas.node_protocol.messages import DETACH_TASK
from tests.caches.conftest import attach_body, make_node, make_tenant, node, reserved, tenant_a  # noqa: F401

pytestmark = pytest.mark.django_db(transaction=True)
NOTHING = {"device": 0, "dram": 0, "ssd": 0}


def attach(tenant, name: str) -> Cache:
    response = tenant.client.post("/api/v1/caches", attach_body(name), format="json")
    assert response.status_code == 201, response.content
    return Cache.objects.get(pk=response.json()["id"])


def later(seconds: float):
    return timezone.now() + timedelta(seconds=seconds)


def test_a_provisioning_the_node_never_answers_fails_after_its_deadline(tenant_a, node, settings):
    cache = attach(tenant_a, "silent")
    assert caches_reconcile_stuck(now=later(settings.KCAAS_PROVISION_DEADLINE_SECONDS - 5)) == []
    assert caches_reconcile_stuck(now=later(settings.KCAAS_PROVISION_DEADLINE_SECONDS + 5)) == [cache.pk]
    cache.refresh_from_db()
    assert (cache.state, cache.failure_reason) == (CacheState.FAILED, "provisioning_timeout")
    assert reserved(node) == NOTHING
    detach = NodeOrder.objects.get(node=node, state__in=[OrderState.PENDING, OrderState.SENT])
    assert detach.task == DETACH_TASK  # the node is told to drop whatever it made; the provisioning is superseded
    event = AuditEvent.objects.filter(target_id=str(cache.pk)).order_by("-id").first()
    assert event.action == AuditAction.CACHE_FAILED and event.actor_kind == "system"
    services.cache_provision_result(cache_id=cache.pk, node_id=node.pk, ok=True, endpoint="10.0.0.1:1")
    cache.refresh_from_db()
    assert cache.state == CacheState.FAILED  # a late answer changes nothing


def test_a_detach_the_node_never_confirms_ends_detached_after_its_deadline(tenant_a, node, settings):
    cache = attach(tenant_a, "gone")
    services.cache_provision_result(cache_id=cache.pk, node_id=node.pk, ok=True, endpoint="10.0.0.1:1")
    assert tenant_a.client.delete(f"/api/v1/caches/{cache.pk}").status_code == 202
    assert caches_reconcile_stuck(now=later(settings.KCAAS_DETACH_DEADLINE_SECONDS - 5)) == []
    assert caches_reconcile_stuck(now=later(settings.KCAAS_DETACH_DEADLINE_SECONDS + 5)) == [cache.pk]
    cache.refresh_from_db()
    assert (cache.state, cache.failure_reason) == (CacheState.DETACHED, "detach_unconfirmed")
    assert reserved(node) == NOTHING
    (detach,) = NodeOrder.objects.filter(node=node, state__in=[OrderState.PENDING, OrderState.SENT])
    assert detach.task == DETACH_TASK  # still sent until the node answers: its pool must not outlive the reservation
    services.cache_detach_result(cache_id=cache.pk, node_id=node.pk)  # the late answer closes it, changes nothing
    assert not NodeOrder.objects.filter(node=node, state__in=[OrderState.PENDING, OrderState.SENT]).exists()
    assert Cache.objects.get(pk=cache.pk).failure_reason == "detach_unconfirmed"
    assert tenant_a.client.post("/api/v1/caches", attach_body("gone"), format="json").status_code == 201  # name free


def test_ready_failed_and_detached_caches_are_never_touched(tenant_a, node):
    ready = attach(tenant_a, "ready")
    services.cache_provision_result(cache_id=ready.pk, node_id=node.pk, ok=True, endpoint="10.0.0.1:1")
    failed = attach(tenant_a, "failed")
    services.cache_provision_result(cache_id=failed.pk, node_id=node.pk, ok=False, reason="allocation_failed")
    assert caches_reconcile_stuck(now=later(10 * 24 * 3600)) == []
    assert Cache.objects.get(pk=ready.pk).state == CacheState.READY
    assert Cache.objects.get(pk=failed.pk).failure_reason == "allocation_failed"


def test_a_ready_cache_the_node_stops_reporting_is_provisioned_again(tenant_a, node, settings):
    """Through the node's own heartbeat: a settled ready cache missing from the resident snapshot lost its pool (the
    register reconciler only sees agent restarts); one the node reports, or one that just became ready, is left."""
    from datetime import timedelta

    from fleet.credentials import credential_new
    from fleet.models import Node
    from tests.caches.conftest import bearer_client

    gone, kept, fresh = (attach(tenant_a, name) for name in ("gone", "kept", "fresh"))
    for cache in (gone, kept, fresh):
        services.cache_provision_result(cache_id=cache.pk, node_id=node.pk, ok=True, endpoint="10.0.0.1:1")
    settled = timezone.now() - timedelta(seconds=10 * settings.KCAAS_NODE_HEARTBEAT_SECONDS)
    Cache.objects.filter(pk__in=[gone.pk, kept.pk]).update(updated_at=settled)
    credential = credential_new()
    Node.objects.filter(pk=node.pk).update(
        credential_public_id=credential.public_id, credential_hash=credential.secret_hash
    )
    resident = [{"cache_id": str(kept.pk), "device_bytes": 0, "dram_bytes": 0, "ssd_bytes": 0}]
    answer = bearer_client(credential.raw).post(
        "/api/v1/nodes/heartbeat",
        {"capacity": {"device": 8 << 30, "dram": 64 << 30, "ssd": 512 << 30}, "resident": resident},
        format="json",
    )
    assert answer.status_code == 200, answer.content
    states = dict(Cache.objects.filter(pk__in=[gone.pk, kept.pk, fresh.pk]).values_list("id", "state"))
    assert states == {gone.pk: CacheState.PROVISIONING, kept.pk: CacheState.READY, fresh.pk: CacheState.READY}
    order = NodeOrder.objects.get(node=node, state__in=[OrderState.PENDING, OrderState.SENT])
    assert order.args == [str(gone.pk), gone.epoch]  # ordered from the node again, at the same epoch
    actions = list(AuditEvent.objects.filter(target_id=str(gone.pk)).order_by("-id").values_list("action", flat=True))
    assert actions[:2] == [AuditAction.CACHE_EMPTIED, AuditAction.CACHE_REPROVISIONED]
    assert Cache.objects.get(pk=gone.pk).emptied_at is not None and Cache.objects.get(pk=kept.pk).emptied_at is None
