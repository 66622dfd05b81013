"""Issue 5, tenants room: each state-changing endpoint (tenants, quotas, API keys) writes exactly one audit event in
the change's transaction, with the actor, tenant, target, changed values, request id and source IP; no-ops and
refused requests write none; when the event cannot be written the change rolls back and the answer is a 503
audit_unavailable. Real endpoints, real keys, PostgreSQL."""

import pytest

from audit.actions import AuditAction
from tenants.models import ApiKey, Quota, Tenant
from tests.audit.events_support import (
    assert_audit_unavailable,
    assert_event,
    audit_insert_fails,
    events_since,
    iso,
    make_tenant,  # noqa: F401 - fixture
    mark,
    only_event_since,
    staff,  # noqa: F401 - fixture
)

pytestmark = pytest.mark.django_db


def test_creating_a_tenant_is_recorded_as_the_staff_user(staff):
    seq = mark()
    response = staff.client.post(
        "/api/v1/admin/tenants", {"name": "Acme GmbH"}, format="json", HTTP_X_REQUEST_ID="req-create-tenant-1"
    )
    assert response.status_code == 201, response.content
    tenant_id = response.json()["id"]
    event = only_event_since(seq)
    assert_event(
        event,
        action=AuditAction.TENANT_CREATED,
        actor=staff.actor,
        target_type="tenant",
        target_id=tenant_id,
        tenant_id=tenant_id,
        old=None,
        new={"name": "Acme GmbH", "status": "active"},
        response=response,
    )
    assert event.request_id == "req-create-tenant-1"  # the caller's own request id is kept

    seq = mark()
    assert staff.client.post("/api/v1/admin/tenants", {"name": "Acme GmbH"}, format="json").status_code == 409
    assert staff.client.post("/api/v1/admin/tenants", {"name": " "}, format="json").status_code == 400
    assert events_since(seq) == []


def test_suspending_and_reactivating_a_tenant_records_the_status_change_once(staff, make_tenant):
    tenant = make_tenant().tenant
    url = f"/api/v1/admin/tenants/{tenant.pk}"
    seq = mark()
    response = staff.client.patch(url, {"status": "suspended"}, format="json")
    assert response.status_code == 200 and response.json()["status"] == "suspended"
    assert_event(
        only_event_since(seq),
        action=AuditAction.TENANT_UPDATED,
        actor=staff.actor,
        target_type="tenant",
        target_id=tenant.pk,
        tenant_id=tenant.pk,
        old={"status": "active"},
        new={"status": "suspended"},
        response=response,
    )

    seq = mark()
    assert staff.client.patch(url, {"status": "suspended"}, format="json").status_code == 200  # no-op
    assert staff.client.patch(url, {}, format="json").status_code == 200  # nothing asked
    assert staff.client.patch(url, {"status": "erased"}, format="json").status_code == 400
    assert (
        staff.client.patch(
            "/api/v1/admin/tenants/00000000-0000-4000-8000-000000000000", {"status": "active"}, format="json"
        ).status_code
        == 404
    )
    assert events_since(seq) == []

    response = staff.client.patch(url, {"status": "active"}, format="json")
    assert_event(
        only_event_since(seq),
        action=AuditAction.TENANT_UPDATED,
        actor=staff.actor,
        target_type="tenant",
        target_id=tenant.pk,
        tenant_id=tenant.pk,
        old={"status": "suspended"},
        new={"status": "active"},
        response=response,
    )


def test_a_quota_update_records_old_and_new_values_of_exactly_the_changed_fields(staff, make_tenant):
    tenant = make_tenant(max_caches=5).tenant
    url = f"/api/v1/admin/tenants/{tenant.pk}/quota"
    seq = mark()
    response = staff.client.patch(
        url, {"max_caches": 7, "max_device_bytes": None, "max_requests_per_second": 100_000}, format="json"
    )  # (device was already the default; rps unchanged)
    assert response.status_code == 200 and response.json()["max_caches"] == 7
    assert_event(
        only_event_since(seq),
        action=AuditAction.QUOTA_UPDATED,
        actor=staff.actor,
        target_type="quota",
        target_id=tenant.pk,
        tenant_id=tenant.pk,
        old={"max_caches": 5},
        new={"max_caches": 7},
        response=response,
    )

    seq = mark()
    assert staff.client.patch(url, {"max_caches": 7}, format="json").status_code == 200  # no change
    assert staff.client.patch(url, {"max_caches": -1}, format="json").status_code == 400
    assert staff.client.patch(url, {"bogus": 1}, format="json").status_code == 400
    assert events_since(seq) == []

    response = staff.client.patch(url, {"max_caches": None}, format="json")  # back to the default
    assert_event(
        only_event_since(seq),
        action=AuditAction.QUOTA_UPDATED,
        actor=staff.actor,
        target_type="quota",
        target_id=tenant.pk,
        tenant_id=tenant.pk,
        old={"max_caches": 7},
        new={"max_caches": None},
        response=response,
    )


def test_a_tenant_key_cannot_change_tenants_or_quotas_and_that_writes_nothing(make_tenant):
    handle = make_tenant()
    seq = mark()
    url = f"/api/v1/admin/tenants/{handle.tenant.pk}"
    assert handle.client.patch(f"{url}/quota", {"max_caches": 9}, format="json").status_code == 403
    assert handle.client.patch(url, {"status": "suspended"}, format="json").status_code == 403
    assert handle.client.post("/api/v1/admin/tenants", {"name": "x"}, format="json").status_code == 403
    assert events_since(seq) == []


def test_issuing_a_key_records_its_public_id_and_scopes_never_its_secret(make_tenant):
    handle = make_tenant()
    seq = mark()
    response = handle.client.post("/api/v1/keys", {"scopes": ["caches:read"], "name": "ci"}, format="json")
    assert response.status_code == 201, response.content
    issued = ApiKey.objects.get(pk=response.json()["id"])
    event = only_event_since(seq)
    assert_event(
        event,
        action=AuditAction.KEY_ISSUED,
        actor=handle.actor,
        target_type="api_key",
        target_id=issued.pk,
        tenant_id=handle.tenant.pk,
        old=None,
        new={"public_id": issued.public_id, "scopes": issued.scopes},
        response=response,
    )
    raw = response.json()["key"]
    secret_part = raw.rsplit("_", 1)[-1]
    assert secret_part not in str(event.chain_fields()) and issued.secret_hash not in str(event.chain_fields())

    reader = make_tenant(scopes=("keys:read",))
    seq = mark()
    refused = reader.client.post("/api/v1/keys", {"scopes": ["keys:read"]}, format="json")
    assert refused.status_code == 403  # keys:write missing
    assert handle.client.post("/api/v1/keys", {"scopes": ["audit:read"]}, format="json").status_code == 403
    assert handle.client.post("/api/v1/keys", {"scopes": []}, format="json").status_code == 400
    assert events_since(seq) == []


def test_revoking_a_key_is_recorded_once_and_another_tenants_key_is_a_silent_404(make_tenant):
    handle, other = make_tenant(), make_tenant()
    victim = ApiKey.objects.get(
        pk=handle.client.post("/api/v1/keys", {"scopes": ["caches:read"]}, format="json").json()["id"]
    )
    seq = mark()
    assert other.client.post(f"/api/v1/keys/{victim.pk}/revoke").status_code == 404
    assert events_since(seq) == []
    response = handle.client.post(f"/api/v1/keys/{victim.pk}/revoke")
    assert response.status_code == 200
    victim.refresh_from_db()
    assert_event(
        only_event_since(seq),
        action=AuditAction.KEY_REVOKED,
        actor=handle.actor,
        target_type="api_key",
        target_id=victim.pk,
        tenant_id=handle.tenant.pk,
        old={"revoked_at": None},
        new={"revoked_at": iso(victim.revoked_at)},
        response=response,
    )

    seq = mark()
    assert handle.client.post(f"/api/v1/keys/{victim.pk}/revoke").status_code == 200  # already revoked: no-op
    assert events_since(seq) == []


def test_rotating_a_key_is_one_event_naming_the_successor(make_tenant):
    handle = make_tenant()
    old = ApiKey.objects.get(
        pk=handle.client.post("/api/v1/keys", {"scopes": ["caches:read"]}, format="json").json()["id"]
    )
    seq = mark()
    response = handle.client.post(f"/api/v1/keys/{old.pk}/rotate", {"overlap_seconds": 600}, format="json")
    assert response.status_code == 201, response.content
    successor = ApiKey.objects.get(pk=response.json()["id"])
    old.refresh_from_db()
    assert_event(
        only_event_since(seq),
        action=AuditAction.KEY_ROTATED,
        actor=handle.actor,
        target_type="api_key",
        target_id=old.pk,
        tenant_id=handle.tenant.pk,
        old={"expires_at": None, "successor": None},
        new={"expires_at": iso(old.expires_at), "successor": successor.public_id, "successor_scopes": successor.scopes},
        response=response,
    )

    seq = mark()
    again = handle.client.post(f"/api/v1/keys/{old.pk}/rotate", {"overlap_seconds": 600}, format="json")
    assert again.status_code == 409  # already rotated
    assert events_since(seq) == []


# ---- fail closed ----------------------------------------------------------------------------------------------------


def test_a_quota_update_whose_event_cannot_be_written_changes_nothing_and_answers_503(staff, make_tenant):
    tenant = make_tenant(max_caches=5).tenant
    seq = mark()
    with audit_insert_fails():
        response = staff.client.patch(f"/api/v1/admin/tenants/{tenant.pk}/quota", {"max_caches": 9}, format="json")
    assert_audit_unavailable(response)
    assert Quota.objects.get(tenant=tenant).max_caches == 5
    assert events_since(seq) == []


def test_a_revocation_whose_event_cannot_be_written_leaves_the_key_working(make_tenant):
    handle = make_tenant()
    seq = mark()
    with audit_insert_fails():
        response = handle.client.post(f"/api/v1/keys/{handle.api_key.pk}/revoke")
    assert_audit_unavailable(response)
    handle.api_key.refresh_from_db()
    assert handle.api_key.revoked_at is None
    assert handle.client.get("/api/v1/whoami").status_code == 200  # the key still works
    assert events_since(seq) == []


def test_tenant_creation_and_key_issue_fail_closed_too(staff, make_tenant):
    handle = make_tenant()
    before = ApiKey.objects.count()
    with audit_insert_fails():
        assert_audit_unavailable(staff.client.post("/api/v1/admin/tenants", {"name": "Ghost"}, format="json"))
        assert_audit_unavailable(handle.client.post("/api/v1/keys", {"scopes": ["caches:read"]}, format="json"))
        assert_audit_unavailable(
            staff.client.patch(f"/api/v1/admin/tenants/{handle.tenant.pk}", {"status": "suspended"}, format="json")
        )
    assert not Tenant.objects.filter(name="Ghost").exists() and ApiKey.objects.count() == before
    assert Tenant.objects.get(pk=handle.tenant.pk).status == "active"
