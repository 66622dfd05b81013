"""Portability (GDPR Art. 20): GET /api/v1/export (a tenant key holding every read scope the archive covers) and
GET /api/v1/admin/tenants/{id}/export (staff): one JSON archive of the tenant's profile, quota, key metadata,
caches, data tokens, usage, billing and audit events — never a secret, never another tenant's rows — audited."""

import json

import pytest

from audit.actions import AuditAction
from audit.models import AuditEvent
from tenants import services as tenant_services
from tests.caches.conftest import attach_body, bearer_client, make_ready

pytestmark = pytest.mark.django_db
EXPORT_SCOPES = ["audit:read", "caches:read", "keys:read", "usage:read"]


@pytest.fixture
def exporting(make_tenant, make_node):
    """A tenant with a named key able to export, a ready cache and a data token (its JWT kept for the checks)."""
    make_node()
    handle = make_tenant(scopes=("caches:write",))
    issued = tenant_services.api_key_issue(tenant=handle.tenant, scopes=EXPORT_SCOPES, name="exporter")
    attached = handle.client.post("/api/v1/caches", attach_body("export-me"), format="json")
    assert attached.status_code == 201, attached.content
    make_ready(attached.json()["id"])
    token = handle.client.post(f"/api/v1/caches/{attached.json()['id']}/tokens", {"access": "read"}, format="json")
    assert token.status_code == 201, token.content
    return handle, issued, attached.json()["id"], token.json()


def test_a_tenant_exports_its_own_data_and_never_a_secret(exporting, tenant_b):
    handle, issued, cache_id, token = exporting
    response = bearer_client(issued.raw_key).get("/api/v1/export")
    assert response.status_code == 200, response.content
    archive = response.json()
    assert archive["format"] == "kcaas.tenant-export" and archive["version"] == 1
    assert archive["tenant"] == {
        "id": str(handle.tenant.pk),
        "name": handle.tenant.name,
        "status": "active",
        "created_at": handle.tenant.created_at.isoformat(),
    }
    assert archive["quota"]["effective"]["max_requests_per_second"] == 100_000
    assert {k["name"] for k in archive["api_keys"]} == {"", "exporter"}
    public_ids = set(handle.tenant.api_keys.values_list("public_id", flat=True))
    assert {k["public_id"] for k in archive["api_keys"]} == public_ids
    assert [(c["id"], c["name"], c["state"]) for c in archive["caches"]] == [(cache_id, "export-me", "ready")]
    assert [t["jti"] for t in archive["data_tokens"]] == [token["jti"]]
    assert archive["usage"]["caches"]["num_caches"] == 1
    assert archive["billing"]["available"] is True and archive["billing"]["invoices"] == []
    actions = {e["action"] for e in archive["audit_events"]}
    assert {AuditAction.CACHE_ATTACHED, AuditAction.DATA_TOKEN_ISSUED} <= actions

    text = json.dumps(archive)
    hashes = handle.tenant.api_keys.values_list("secret_hash", flat=True)
    secrets = [issued.raw_key, handle.raw_key, token["token"], *hashes]
    assert not [s for s in secrets if s in text]
    assert "hash_key" not in text and "secret_hash" not in text
    assert str(tenant_b.tenant.pk) not in text and tenant_b.tenant.name not in text  # isolation

    exported = AuditEvent.objects.filter(action=AuditAction.DATA_EXPORTED, tenant_id=handle.tenant.pk)
    assert exported.count() == 1 and exported.get().actor_id == issued.api_key.public_id


def test_the_export_needs_every_read_scope_it_covers(exporting):
    handle, _, _, _ = exporting
    refused = handle.client.get("/api/v1/export")  # caches:write only
    assert refused.status_code == 403
    details = refused.json()["error"]["details"]
    assert details["missing"] == ["audit:read", "keys:read", "usage:read"]
    assert not AuditEvent.objects.filter(action=AuditAction.DATA_EXPORTED).exists()
    assert handle.client.get(f"/api/v1/admin/tenants/{handle.tenant.pk}/export").status_code == 403


def test_staff_export_any_tenant_and_only_that_one(staff_client, exporting, tenant_b):
    handle, _, cache_id, _ = exporting
    archive = staff_client.get(f"/api/v1/admin/tenants/{tenant_b.tenant.pk}/export").json()
    assert archive["tenant"]["id"] == str(tenant_b.tenant.pk) and archive["caches"] == []
    text = json.dumps(archive)
    assert str(handle.tenant.pk) not in text and cache_id not in text and handle.tenant.name not in text
    missing = staff_client.get("/api/v1/admin/tenants/00000000-0000-4000-8000-000000000000/export")
    assert missing.status_code == 404
    event = AuditEvent.objects.get(action=AuditAction.DATA_EXPORTED, tenant_id=tenant_b.tenant.pk)
    assert event.actor_kind == "user"
