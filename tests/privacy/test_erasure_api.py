"""The erasure job over REST (staff), without node consumers: request, idempotency, cancel inside the grace window,
the beat moving due jobs, the signed receipt (in process and with the stand-alone verifier as a subprocess), what
the erased tenant's keys and rows look like afterwards, and the audit trail (intact, no trace of the tenant)."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from audit.actions import AuditAction
from audit.keys import platform_public_jwk
from audit.models import AuditEvent
from audit.services import tenant_pseudonym
from caches.models import IdempotencyRecord
from privacy import receipt as receipts
from privacy import services
from privacy.models import ErasureJob
from tenants.models import ApiKey, Tenant, TenantKey
from tenants.tenant_keys import tenant_key_ensure
from tests.privacy.conftest import audit_chain_problems, audit_rows_mentioning

pytestmark = pytest.mark.django_db
VERIFIER = Path(__file__).resolve().parents[2] / "platform" / "privacy" / "receipt_verify.py"


def erasure_url(tenant_id, suffix: str = "") -> str:
    return f"/api/v1/admin/tenants/{tenant_id}/erasure{suffix}"


def actions_about(job_id) -> list[int]:
    events = AuditEvent.objects.filter(target_type="erasure_job", target_id=str(job_id))
    return list(events.values_list("action", flat=True))


def test_request_is_staff_only_and_idempotent(staff_client, tenant_a):
    tenant_id = tenant_a.tenant.pk
    refused = tenant_a.client.post(erasure_url(tenant_id))
    assert refused.status_code == 403
    first = staff_client.post(erasure_url(tenant_id))
    assert first.status_code == 201, first.content
    body = first.json()
    assert body["state"] == "scheduled" and body["scheduled_for"] > body["requested_at"]
    assert body["requested_by"].startswith("user:") and body["receipt_available"] is False
    second = staff_client.post(erasure_url(tenant_id))
    assert second.status_code == 200 and second.json()["id"] == body["id"]
    assert ErasureJob.objects.filter(tenant_id=tenant_id).count() == 1
    assert actions_about(body["id"]) == [AuditAction.ERASURE_REQUESTED]
    assert staff_client.get(erasure_url(tenant_id)).json()["id"] == body["id"]
    assert staff_client.get(erasure_url(tenant_id, "/receipt")).json()["error"]["code"] == "erasure_not_complete"
    missing = staff_client.post(erasure_url("00000000-0000-4000-8000-000000000000"))
    assert missing.status_code == 404


def test_cancel_inside_the_grace_window_leaves_the_tenant_untouched(staff_client, tenant_a):
    tenant_id = tenant_a.tenant.pk
    job_id = staff_client.post(erasure_url(tenant_id)).json()["id"]
    cancelled = staff_client.post(erasure_url(tenant_id, "/cancel"))
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
    assert staff_client.post(erasure_url(tenant_id, "/cancel")).json()["id"] == job_id  # idempotent
    assert services.erasures_run_due() == []  # beat has nothing to start
    assert tenant_a.client.get("/api/v1/caches").status_code == 200  # the tenant's key still works
    assert Tenant.objects.get(pk=tenant_id).status == "active"
    assert actions_about(job_id) == [AuditAction.ERASURE_REQUESTED, AuditAction.ERASURE_CANCELLED]
    fresh = staff_client.post(erasure_url(tenant_id))  # a new request after a cancel is a new job
    assert fresh.status_code == 201 and fresh.json()["id"] != job_id


def test_cancel_is_refused_once_the_erasure_runs(staff_client, tenant_a, make_node, no_grace):
    make_node()  # a node that never answers: the job stays running
    tenant_id = tenant_a.tenant.pk
    staff_client.post(erasure_url(tenant_id))
    services.erasures_run_due()
    assert staff_client.get(erasure_url(tenant_id)).json()["state"] == "running"
    refused = staff_client.post(erasure_url(tenant_id, "/cancel"))
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "erasure_not_cancellable"
    assert staff_client.get(erasure_url(tenant_id)).json()["purges"][0]["state"] == "pending"


def erase_without_nodes(staff_client, tenant) -> dict:
    staff_client.post(erasure_url(tenant.pk))
    services.erasures_run_due()  # starts it; no node to wait for, so the same pass completes it
    job = staff_client.get(erasure_url(tenant.pk)).json()
    assert job["state"] == "complete", job
    receipt = staff_client.get(erasure_url(tenant.pk, "/receipt"))
    assert receipt.status_code == 200
    return receipt.json()


def test_completed_erasure_revokes_keys_deletes_personal_data_and_signs_a_receipt(
    staff_client, tenant_a, tenant_b, no_grace
):
    tenant, name = tenant_a.tenant, tenant_a.tenant.name
    named_key = tenant_a.tenant.api_keys.create(name="ci-runner", public_id="pubid0000000001", secret_hash="0" * 64)
    IdempotencyRecord.objects.create(
        tenant=tenant, key="k1", fingerprint="f" * 64, locked_at=tenant.created_at, expires_at=tenant.created_at
    )
    key_id = tenant_key_ensure(tenant_id=tenant.pk).key_id
    assert audit_rows_mentioning(str(tenant.pk), name)  # the trail knew the tenant before
    envelope = erase_without_nodes(staff_client, tenant)

    refused = tenant_a.client.get("/api/v1/caches")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "api_key_revoked"
    assert tenant_b.client.get("/api/v1/caches").status_code == 200  # another tenant is untouched
    tenant.refresh_from_db()
    assert tenant.status == "erased" and tenant.name == f"erased-{tenant_pseudonym(tenant.pk)}"
    named_key.refresh_from_db()
    assert named_key.name == "" and named_key.revoked_at is not None
    assert not IdempotencyRecord.objects.filter(tenant=tenant).exists()
    assert TenantKey.objects.get(tenant=tenant).wrapped_key is None

    body = receipts.receipt_verify(envelope)
    assert body["tenant_id"] == str(tenant.pk) and body["nodes"] == [] and body["bytes_freed"] == 0
    assert {k["public_id"] for k in body["api_keys_revoked"]} == set(
        ApiKey.objects.filter(tenant=tenant).values_list("public_id", flat=True)
    )
    assert body["key_material_destroyed"][0]["key_id"] == key_id
    assert body["records_deleted"]["idempotency_records"] == 1 and body["audit_events_pseudonymised"] >= 1

    assert audit_chain_problems() == []
    assert audit_rows_mentioning(str(tenant.pk), name) == []
    job_id = ErasureJob.objects.get(tenant_id=tenant.pk).pk
    assert AuditAction.ERASURE_COMPLETED in actions_about(job_id)

    again = staff_client.post(erasure_url(tenant.pk))
    assert again.status_code == 200 and again.json()["state"] == "complete"
    assert staff_client.get(erasure_url(tenant.pk, "/receipt")).json() == envelope  # the same receipt


def test_the_receipt_verifies_offline_and_a_tampered_one_fails(staff_client, tenant_a, no_grace, tmp_path):
    envelope = erase_without_nodes(staff_client, tenant_a.tenant)
    key_file = tmp_path / "platform-key.json"
    key_file.write_text(json.dumps(platform_public_jwk()))

    def verify(document) -> subprocess.CompletedProcess:
        path = tmp_path / "receipt.json"
        path.write_text(json.dumps(document))
        return subprocess.run(
            [sys.executable, str(VERIFIER), str(path), str(key_file)], capture_output=True, text=True, timeout=60
        )

    good = verify(envelope)
    assert good.returncode == 0 and good.stdout.startswith("OK"), good.stdout + good.stderr
    tampered = copy.deepcopy(envelope)
    tampered["receipt"]["bytes_freed"] += 1
    bad = verify(tampered)
    assert bad.returncode == 1 and "FAILED" in bad.stdout
    with pytest.raises(ValueError):
        receipts.receipt_verify(tampered)


def test_a_failing_step_rolls_back_to_error_and_a_new_request_retries_it(staff_client, tenant_a, no_grace, settings):
    tenant = tenant_a.tenant
    tenant_key_ensure(tenant_id=tenant.pk)
    staff_client.post(erasure_url(tenant.pk))
    settings.KCAAS_PLATFORM_SIGNING_KEY_PEM = "not a key"  # the receipt cannot be signed: the finish fails
    services.erasures_run_due()
    job = staff_client.get(erasure_url(tenant.pk)).json()
    assert job["state"] == "error" and job["error"].startswith("erasure_finish:")
    tenant.refresh_from_db()
    assert tenant.status == "erasing" and not tenant.name.startswith("erased-")  # the finish rolled back whole
    assert TenantKey.objects.get(tenant=tenant).wrapped_key is not None
    assert AuditAction.ERASURE_FAILED in actions_about(job["id"])

    settings.KCAAS_PLATFORM_SIGNING_KEY_PEM = ""
    retried = staff_client.post(erasure_url(tenant.pk))
    assert retried.status_code == 200 and retried.json()["id"] == job["id"] and retried.json()["state"] == "scheduled"
    services.erasures_run_due()
    assert staff_client.get(erasure_url(tenant.pk)).json()["state"] == "complete"
    receipts.receipt_verify(staff_client.get(erasure_url(tenant.pk, "/receipt")).json())
    assert audit_chain_problems() == [] and audit_rows_mentioning(str(tenant.pk)) == []
