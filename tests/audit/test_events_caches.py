"""Issue 5, caches room: attach, detach, data tokens (issue, revoke one, revoke all), the node's answers (as the
node, through the control-queue task bodies), re-provisioning on re-registration and the lost-node sweep (as the
system) each write exactly one audit event per change, with the cache's tenant; duplicates, repeats and refusals
write none; a failed audit write rolls the change back and answers 503 audit_unavailable. The same answers
travelling through real Celery workers are in test_events_caches_celery.py."""

from datetime import timedelta

import pytest
from django.utils import timezone

from audit.actions import AuditAction
from audit.services import AuditWriteError
from caches import tasks as caches_tasks
from caches.models import Cache, DataToken
from fleet.models import Node
from kcaas.node_protocol.messages import DetachResult, ProvisionResult
from tests.audit.events_support import (
    assert_audit_unavailable,
    assert_event,
    audit_insert_fails,
    events_since,
    iso,
    make_node,  # noqa: F401 - fixture
    make_tenant,  # noqa: F401 - fixture
    mark,
    only_event_since,
)
from tests.caches.conftest import attach_body

pytestmark = pytest.mark.django_db

NOTHING = {"device": 0, "dram": 0, "ssd": 0}


def reserved(node) -> dict:
    node.refresh_from_db()
    return node.reserved


def attach(handle, name="c1", **headers):
    response = handle.client.post("/api/v1/caches", attach_body(name), format="json", **headers)
    assert response.status_code == 201, response.content
    return response


def answer_provisioning(cache_id, node, ok=True, reason=""):
    """The body of the control-queue task the node's answer runs (acting as that node)."""
    answer = ProvisionResult(
        cache_id=str(cache_id), node_id=str(node.pk), ok=ok, reason=reason, endpoint=node.endpoint if ok else ""
    )
    return caches_tasks.provision_result(**answer.to_dict())


@pytest.fixture
def ready_cache(make_tenant, make_node):
    handle, node = make_tenant(), make_node()
    cache_id = attach(handle).json()["id"]
    assert answer_provisioning(cache_id, node.node) == "ready"
    return handle, node, Cache.objects.get(pk=cache_id)


def test_attaching_a_cache_is_recorded_as_the_tenant_key(make_tenant, make_node):
    handle, node = make_tenant(), make_node()
    seq = mark()
    response = attach(handle, HTTP_X_REQUEST_ID="attach-req-0001")
    cache = Cache.objects.get(pk=response.json()["id"])
    event = only_event_since(seq)
    assert_event(
        event,
        action=AuditAction.CACHE_ATTACHED,
        actor=handle.actor,
        target_type="cache",
        target_id=cache.pk,
        tenant_id=handle.tenant.pk,
        old=None,
        new={
            "name": "c1",
            "spec": cache.spec_dict(),
            "capacity": cache.capacity(),
            "network_write_through": False,
            "node_id": str(node.node.pk),
            "epoch": 1,
            "state": "provisioning",
        },
        response=response,
    )
    assert event.request_id == "attach-req-0001"


def test_refused_and_replayed_attaches_write_nothing(make_tenant, make_node):
    handle, full, reader = make_tenant(), make_tenant(max_caches=0), make_tenant(scopes=("caches:read",))
    make_node()
    attach(handle, "first", HTTP_IDEMPOTENCY_KEY="attach-once")
    seq = mark()
    replay = handle.client.post(
        "/api/v1/caches", attach_body("first"), format="json", HTTP_IDEMPOTENCY_KEY="attach-once"
    )
    assert replay.status_code == 201 and replay["Idempotent-Replayed"] == "true"
    assert handle.client.post("/api/v1/caches", attach_body("first"), format="json").status_code == 409  # name taken
    assert full.client.post("/api/v1/caches", attach_body("x"), format="json").status_code == 403  # quota
    assert reader.client.post("/api/v1/caches", attach_body("x"), format="json").status_code == 403  # scope
    assert handle.client.post("/api/v1/caches", attach_body("x", device=1), format="json").status_code == 400
    assert events_since(seq) == []


def test_the_nodes_answers_are_recorded_as_the_node_and_duplicates_are_not(make_tenant, make_node):
    handle, node = make_tenant(), make_node()
    ok_id, bad_id = attach(handle, "ok").json()["id"], attach(handle, "bad").json()["id"]
    seq = mark()
    assert answer_provisioning(ok_id, node.node) == "ready"
    assert_event(
        only_event_since(seq),
        action=AuditAction.CACHE_READY,
        actor=node.actor,
        target_type="cache",
        target_id=ok_id,
        tenant_id=handle.tenant.pk,
        old={"state": "provisioning", "endpoint": ""},
        new={"state": "ready", "endpoint": node.node.endpoint},
    )

    seq = mark()
    assert answer_provisioning(bad_id, node.node, ok=False, reason="out of device memory") == "failed"
    assert_event(
        only_event_since(seq),
        action=AuditAction.CACHE_FAILED,
        actor=node.actor,
        target_type="cache",
        target_id=bad_id,
        tenant_id=handle.tenant.pk,
        old={"state": "provisioning", "failure_reason": ""},
        new={"state": "failed", "failure_reason": "out of device memory"},
    )

    stranger = make_node()
    seq = mark()
    assert answer_provisioning(ok_id, node.node) == "ready"  # a duplicate delivery
    assert answer_provisioning(bad_id, node.node) == "failed"  # a stale one
    assert answer_provisioning(ok_id, stranger.node, ok=False) == "ready"  # another node's word changes nothing
    assert events_since(seq) == []


def test_detach_then_the_nodes_confirmation_each_write_one_event(ready_cache, make_tenant):
    handle, node, cache = ready_cache
    other = make_tenant()
    seq = mark()
    assert other.client.delete(f"/api/v1/caches/{cache.pk}").status_code == 404
    assert events_since(seq) == []
    response = handle.client.delete(f"/api/v1/caches/{cache.pk}")
    assert response.status_code == 202
    assert_event(
        only_event_since(seq),
        action=AuditAction.CACHE_DETACH_REQUESTED,
        actor=handle.actor,
        target_type="cache",
        target_id=cache.pk,
        tenant_id=handle.tenant.pk,
        old={"state": "ready"},
        new={"state": "detaching"},
        response=response,
    )

    seq = mark()
    assert handle.client.delete(f"/api/v1/caches/{cache.pk}").status_code == 202  # already detaching: no-op
    assert events_since(seq) == []
    detached = DetachResult(cache_id=str(cache.pk), node_id=str(node.node.pk)).to_dict()
    assert caches_tasks.detach_result(**detached) == "detached"
    assert_event(
        only_event_since(seq),
        action=AuditAction.CACHE_DETACHED,
        actor=node.actor,
        target_type="cache",
        target_id=cache.pk,
        tenant_id=handle.tenant.pk,
        old={"state": "detaching"},
        new={"state": "detached"},
    )
    assert reserved(node.node) == NOTHING

    seq = mark()
    assert caches_tasks.detach_result(**detached) == "detached"  # duplicate answer
    assert handle.client.delete(f"/api/v1/caches/{cache.pk}").status_code in (200, 202)  # already detached
    assert events_since(seq) == []


def test_detaching_a_failed_cache_is_one_event_straight_to_detached(make_tenant, make_node):
    handle, node = make_tenant(), make_node()
    cache_id = attach(handle).json()["id"]
    answer_provisioning(cache_id, node.node, ok=False, reason="boom")
    seq = mark()
    response = handle.client.delete(f"/api/v1/caches/{cache_id}")
    assert_event(
        only_event_since(seq),
        action=AuditAction.CACHE_DETACH_REQUESTED,
        actor=handle.actor,
        target_type="cache",
        target_id=cache_id,
        tenant_id=handle.tenant.pk,
        old={"state": "failed"},
        new={"state": "detached"},
        response=response,
    )


def test_data_tokens_issue_and_revocation_are_recorded_never_the_token(ready_cache):
    handle, node, cache = ready_cache
    seq = mark()
    response = handle.client.post(f"/api/v1/caches/{cache.pk}/tokens", {"access": "readwrite"}, format="json")
    assert response.status_code == 201, response.content
    jti = response.json()["jti"]
    token = DataToken.objects.get(jti=jti)
    event = only_event_since(seq)
    assert_event(
        event,
        action=AuditAction.DATA_TOKEN_ISSUED,
        actor=handle.actor,
        target_type="data_token",
        target_id=jti,
        tenant_id=handle.tenant.pk,
        old=None,
        new={"cache_id": str(cache.pk), "access": "readwrite", "epoch": 1, "expires_at": iso(token.expires_at)},
        response=response,
    )
    assert response.json()["token"].split(".")[-1] not in str(event.chain_fields())
    second = handle.client.post(f"/api/v1/caches/{cache.pk}/tokens", {}, format="json").json()["jti"]

    seq = mark()
    response = handle.client.post(f"/api/v1/caches/{cache.pk}/tokens/{jti}/revoke")
    assert response.status_code == 200 and response.json() == {"revoked": 1}
    token.refresh_from_db()
    assert_event(
        only_event_since(seq),
        action=AuditAction.DATA_TOKENS_REVOKED,
        actor=handle.actor,
        target_type="cache",
        target_id=cache.pk,
        tenant_id=handle.tenant.pk,
        old=None,
        new={"revoked": 1, "jti": jti, "revoked_at": iso(token.revoked_at)},
        response=response,
    )

    seq = mark()
    assert handle.client.post(f"/api/v1/caches/{cache.pk}/tokens/{jti}/revoke").json() == {"revoked": 0}  # no-op
    assert events_since(seq) == []
    response = handle.client.post(f"/api/v1/caches/{cache.pk}/tokens/revoke")
    assert response.json() == {"revoked": 1}
    revoked_at = DataToken.objects.get(jti=second).revoked_at
    assert_event(
        only_event_since(seq),
        action=AuditAction.DATA_TOKENS_REVOKED,
        actor=handle.actor,
        target_type="cache",
        target_id=cache.pk,
        tenant_id=handle.tenant.pk,
        old=None,
        new={"revoked": 1, "jti": None, "revoked_at": iso(revoked_at)},
        response=response,
    )
    seq = mark()
    assert handle.client.post(f"/api/v1/caches/{cache.pk}/tokens/revoke").json() == {"revoked": 0}
    assert events_since(seq) == []


def test_refused_token_requests_write_nothing(ready_cache, make_tenant, make_node):
    handle, node, cache = ready_cache
    other, writer_only = make_tenant(), make_tenant(scopes=("keys:read",))
    pending_id = attach(handle, "pending").json()["id"]
    seq = mark()
    assert handle.client.post(f"/api/v1/caches/{pending_id}/tokens", {}, format="json").status_code == 409
    assert other.client.post(f"/api/v1/caches/{cache.pk}/tokens", {}, format="json").status_code == 404
    assert writer_only.client.post(f"/api/v1/caches/{cache.pk}/tokens", {}, format="json").status_code == 403
    assert other.client.post(f"/api/v1/caches/{cache.pk}/tokens/revoke").status_code == 404
    assert (
        handle.client.post(f"/api/v1/caches/{cache.pk}/tokens/00000000-0000-4000-8000-000000000001/revoke").status_code
        == 404
    )
    assert events_since(seq) == []


def test_a_node_that_re_registers_without_its_caches_has_them_reprovisioned_on_the_record(ready_cache):
    handle, node, cache = ready_cache
    seq = mark()
    response = node.client.post(
        "/api/v1/nodes/register",
        {
            "endpoint": node.node.endpoint,
            "caches": [],
            "capacity": {"device": 8 * 2**30, "dram": 64 * 2**30, "ssd": 512 * 2**30},
        },
        format="json",
    )
    assert response.status_code == 200, response.content
    registered, reprovisioned, emptied = events_since(seq)
    assert registered.action == AuditAction.NODE_REGISTERED and registered.actor_id == str(node.node.pk)
    assert_event(
        reprovisioned,
        action=AuditAction.CACHE_REPROVISIONED,
        actor=node.actor,
        target_type="cache",
        target_id=cache.pk,
        tenant_id=handle.tenant.pk,
        old={"state": "ready"},
        new={"state": "provisioning"},
        response=response,
    )
    cache.refresh_from_db()
    assert_event(
        emptied,
        action=AuditAction.CACHE_EMPTIED,
        actor=node.actor,
        target_type="cache",
        target_id=cache.pk,
        tenant_id=handle.tenant.pk,
        old=None,
        new={"emptied_at": iso(cache.emptied_at), "node_id": str(node.node.pk)},
        response=response,
    )


def test_the_sweep_records_lost_nodes_and_their_caches_as_the_system(ready_cache, make_tenant):
    handle, node, cache = ready_cache
    leaving_id = attach(handle, "leaving").json()["id"]
    answer_provisioning(leaving_id, node.node)
    assert handle.client.delete(f"/api/v1/caches/{leaving_id}").status_code == 202
    Node.objects.filter(pk=node.node.pk).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    seq = mark()
    assert caches_tasks.sweep_leases() == 2
    lost, *flagged = events_since(seq)
    assert_event(
        lost,
        action=AuditAction.NODE_LOST,
        actor=("system", ""),
        target_type="node",
        target_id=node.node.pk,
        tenant_id=None,
        old={"state": "ready"},
        new={"state": "lost"},
    )
    by_cache = {event.target_id: event for event in flagged}
    assert set(by_cache) == {str(cache.pk), leaving_id}
    assert_event(
        by_cache[str(cache.pk)],
        action=AuditAction.CACHE_FAILED,
        actor=("system", ""),
        target_type="cache",
        target_id=cache.pk,
        tenant_id=handle.tenant.pk,
        old={"state": "ready", "failure_reason": ""},
        new={"state": "failed", "failure_reason": "node_lost"},
    )
    assert_event(
        by_cache[leaving_id],
        action=AuditAction.CACHE_DETACHED,
        actor=("system", ""),
        target_type="cache",
        target_id=leaving_id,
        tenant_id=handle.tenant.pk,
        old={"state": "detaching"},
        new={"state": "detached"},
    )
    seq = mark()
    assert caches_tasks.sweep_leases() == 0
    assert events_since(seq) == []


# ---- fail closed ----------------------------------------------------------------------------------------------------


def test_an_attach_whose_event_cannot_be_written_leaves_no_cache_and_no_reservation(make_tenant, make_node):
    handle, node = make_tenant(), make_node()
    with audit_insert_fails():
        response = handle.client.post("/api/v1/caches", attach_body(), format="json", HTTP_IDEMPOTENCY_KEY="k-503")
    assert_audit_unavailable(response)
    assert not Cache.objects.filter(tenant=handle.tenant).exists() and reserved(node.node) == NOTHING
    retry = handle.client.post("/api/v1/caches", attach_body(), format="json", HTTP_IDEMPOTENCY_KEY="k-503")
    assert retry.status_code == 201  # the refusal was not stored under the key: the retry runs


def test_token_issue_revoke_and_detach_fail_closed(ready_cache):
    handle, node, cache = ready_cache
    jti = handle.client.post(f"/api/v1/caches/{cache.pk}/tokens", {}, format="json").json()["jti"]
    tokens = DataToken.objects.count()
    seq = mark()
    with audit_insert_fails():
        assert_audit_unavailable(handle.client.post(f"/api/v1/caches/{cache.pk}/tokens", {}, format="json"))
        assert_audit_unavailable(handle.client.post(f"/api/v1/caches/{cache.pk}/tokens/{jti}/revoke"))
        assert_audit_unavailable(handle.client.delete(f"/api/v1/caches/{cache.pk}"))
    assert DataToken.objects.count() == tokens and DataToken.objects.get(jti=jti).revoked_at is None
    assert Cache.objects.get(pk=cache.pk).state == "ready"
    assert events_since(seq) == []


def test_a_nodes_answer_whose_event_cannot_be_written_is_retried_not_applied_then_applied(make_tenant, make_node):
    handle, node = make_tenant(), make_node()
    cache_id = attach(handle).json()["id"]
    kwargs = ProvisionResult(
        cache_id=cache_id, node_id=str(node.node.pk), ok=True, reason="", endpoint=node.node.endpoint
    ).to_dict()
    seq = mark()
    with audit_insert_fails():
        outcome = caches_tasks.provision_result.apply(kwargs=kwargs)  # eager: its retries run at once, all refused
    assert outcome.failed() and isinstance(outcome.result, AuditWriteError)
    assert outcome.result is not None and caches_tasks.provision_result.max_retries == 30
    assert Cache.objects.get(pk=cache_id).state == "provisioning" and events_since(seq) == []
    assert caches_tasks.provision_result.apply(kwargs=kwargs).get() == "ready"  # the trail is back: the answer lands
    assert only_event_since(seq).action == AuditAction.CACHE_READY
