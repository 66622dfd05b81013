"""The console's GDPR page: the erasure jobs of every tenant (states, progress, receipts; a live fragment), the erasure
request (choose, type the name, POST), cancel inside the grace window (409 once it runs), the signed receipt, the
portability export; the role matrix and bad input. Jobs are built through privacy.services, as the REST API does."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from audit.actions import AuditAction
from audit.keys import platform_public_jwk
from audit.models import AuditEvent
from audit.services import tenant_pseudonym
from console import roles
from privacy import services
from privacy.models import ErasureJob
from privacy.receipt_verify import verify
from tests.caches.conftest import make_node, make_tenant  # noqa: F401 - the caches room's fixtures
from tests.console.conftest import csrf_token

pytestmark = pytest.mark.django_db

PAGE = "/console/gdpr/"
LIVE = "/console/gdpr/live"
NEW = "/console/gdpr/erasures/new"
EXPORT = "/console/gdpr/export"
UNKNOWN = "00000000-0000-4000-8000-000000000000"
LONG_AGO = timedelta(days=3)


def request_url(tenant_id) -> str:
    return f"/console/gdpr/tenants/{tenant_id}/erasure"


def events(action: AuditAction, job: ErasureJob | None = None) -> list[AuditEvent]:
    found = AuditEvent.objects.filter(action=int(action)).order_by("seq")
    return list(found.filter(target_id=str(job.pk)) if job is not None else found)


def job_of(tenant) -> ErasureJob:
    return ErasureJob.objects.get(tenant_id=tenant.pk)


def scheduled(tenant, *, now=None) -> ErasureJob:
    return services.erasure_request(tenant_id=tenant.pk, requested_by="user:1", now=now)[0]


def completed(tenant) -> ErasureJob:
    """Request long ago (past the grace) and run the beat with no node registered: it starts and completes."""
    scheduled(tenant, now=timezone.now() - LONG_AGO)
    services.erasures_run_due()
    job = job_of(tenant)
    assert job.state == "complete"
    return job


def running(tenant, nodes, *, confirmed=()) -> ErasureJob:
    """Past the grace and started: one purge per node, those of `confirmed` answered."""
    scheduled(tenant, now=timezone.now() - LONG_AGO)
    services.erasures_run_due()
    job = job_of(tenant)
    for node in confirmed:
        services.erasure_purge_confirmed(job_id=job.pk, node_id=node.pk, tenant_id=tenant.pk, purged=[])
    job.refresh_from_db()
    assert job.state == "running"
    return job


# ---- the jobs page ---------------------------------------------------------------------------------------------------


def test_empty_state(readonly_client):
    page = readonly_client.get(PAGE)
    assert page.status_code == 200 and b'class="empty"' in page.content
    assert b"No erasure has been requested yet." in page.content
    assert page["Cache-Control"] == "no-store"


def test_every_job_with_its_state_progress_and_receipt(readonly_client, make_tenant, make_node):
    erased = make_tenant().tenant
    erased_name = erased.name
    completed(erased)  # before any node registers: nothing to purge
    nodes = [make_node(), make_node(), make_node()]
    busy = make_tenant().tenant
    running(busy, nodes, confirmed=nodes[:2])
    waiting, failed, cancelled = (make_tenant().tenant for _ in range(3))
    waiting_job = scheduled(waiting)
    services.erasure_fail(job_id=scheduled(failed).pk, reason="erasure_start: boom")
    scheduled(cancelled)
    services.erasure_cancel(tenant_id=cancelled.pk)

    html = readonly_client.get(PAGE).content.decode()
    assert erased_name not in html and f"erased-{tenant_pseudonym(erased.pk)}" in html
    for tenant in (busy, waiting, failed, cancelled):
        assert tenant.name in html
    for state in ("complete", "running", "scheduled", "error", "cancelled"):
        assert f'<span class="badge state-{state}">{state}</span>' in html
    assert '<progress max="3" value="2"' in html and "2 of 3 nodes purged" in html
    assert "erasure_start: boom" in html
    assert waiting_job.scheduled_for.strftime("%Y-%m-%d %H:%M") in html
    assert "Receipt verifies" in html and "user:1" in html
    order = [html.index(t.name) for t in (cancelled, failed, waiting)]
    assert order == sorted(order)  # newest request first
    assert "Cancel…" not in html and "Download receipt" not in html  # read-only: no actions
    assert 'hx-trigger="every 5s"' in html and 'hx-headers=\'{"X-Console-Poll": "1"}\'' in html


def test_a_tampered_receipt_is_shown_as_not_verifying(compliance_client, make_tenant):
    job = completed(make_tenant().tenant)
    ErasureJob.objects.filter(pk=job.pk).update(receipt={**job.receipt, "bytes_freed": 999})
    html = compliance_client.get(PAGE).content.decode()
    assert "Receipt does not verify" in html and "Receipt verifies" not in html


def test_jobs_are_paged_by_25(readonly_client, make_tenant):
    start = timezone.now() - timedelta(hours=1)
    tenants = [make_tenant().tenant for _ in range(26)]
    for minute, tenant in enumerate(tenants):
        scheduled(tenant, now=start + timedelta(minutes=minute))
    first = readonly_client.get(PAGE).content.decode()
    assert "Page 1 of 2 (26 in all)" in first
    assert tenants[-1].name in first and tenants[0].name not in first
    second = readonly_client.get(PAGE, {"page": 2}).content.decode()
    assert tenants[0].name in second and tenants[-1].name not in second
    assert f'hx-get="{LIVE}?page=2"' in second
    for bad in ("abc", "-1", "9" * 40):
        assert readonly_client.get(PAGE, {"page": bad}).status_code == 200


def test_live_partial_is_only_the_fragment(readonly_client, make_tenant):
    tenant = make_tenant().tenant
    scheduled(tenant)
    fragment = readonly_client.get(LIVE, HTTP_HX_REQUEST="true", HTTP_X_CONSOLE_POLL="1")
    text = fragment.content.decode()
    assert fragment.status_code == 200 and tenant.name in text
    assert text.lstrip().startswith('<div id="erasure-jobs"') and "<html" not in text and "<nav" not in text
    whole = readonly_client.get(LIVE)
    assert whole.status_code == 200 and b"<html" in whole.content and tenant.name.encode() in whole.content


# ---- request an erasure ----------------------------------------------------------------------------------------------


def test_request_flow_confirms_the_typed_name(console_client, make_tenant):
    client = console_client(roles.COMPLIANCE, csrf=True)
    tenant = make_tenant().tenant
    form = client.get(NEW)
    assert form.status_code == 200 and b'<label for="id_tenant">' in form.content
    confirm = client.get(NEW, {"tenant": tenant.name})
    assert confirm.status_code == 200
    assert f"Type <strong>{tenant.name}</strong> to confirm".encode() in confirm.content
    assert f'action="{request_url(tenant.pk)}"'.encode() in confirm.content
    token = {"csrfmiddlewaretoken": csrf_token(client)}

    mismatch = client.post(request_url(tenant.pk), {"confirm": tenant.name + "x", **token})
    assert mismatch.status_code == 400 and b"not the tenant&#x27;s name" in mismatch.content
    assert not ErasureJob.objects.exists() and not events(AuditAction.ERASURE_REQUESTED)

    done = client.post(request_url(tenant.pk), {"confirm": tenant.name, **token}, follow=True)
    job = job_of(tenant)
    assert done.status_code == 200 and job.state == "scheduled"
    assert job.requested_by == f"user:{client.user.pk}"
    assert f"Erasure of {tenant.name} requested: scheduled to start at {job.scheduled_for:%Y-%m-%d %H:%M} UTC" in (
        done.content.decode()
    )
    [event] = events(AuditAction.ERASURE_REQUESTED, job)
    assert (event.actor_kind, event.actor_id, event.tenant_id) == ("user", str(client.user.pk), tenant.pk)
    assert f"{client.user.username} (user:{client.user.pk})" in client.get(PAGE).content.decode()

    again = client.post(request_url(tenant.pk), {"confirm": tenant.name, **token}, follow=True)
    assert "already has this erasure job (scheduled" in again.content.decode()
    assert ErasureJob.objects.filter(tenant_id=tenant.pk).count() == 1
    assert len(events(AuditAction.ERASURE_REQUESTED)) == 1


def test_the_tenant_may_be_chosen_by_id_and_a_failed_job_is_retried(compliance_client, make_tenant):
    tenant = make_tenant().tenant
    confirm = compliance_client.get(NEW, {"tenant": str(tenant.pk)})
    assert confirm.status_code == 200 and f"<strong>{tenant.name}</strong>".encode() in confirm.content
    job = scheduled(tenant)
    services.erasure_fail(job_id=job.pk, reason="boom")
    page = compliance_client.post(request_url(tenant.pk), {"confirm": tenant.name}, follow=True)
    assert "is retried: error -&gt; scheduled" in page.content.decode()
    job.refresh_from_db()
    assert job.state == "scheduled" and job.error == ""
    assert events(AuditAction.ERASURE_REQUESTED, job)[-1].new_values["retry"] is True


# ---- cancel ----------------------------------------------------------------------------------------------------------


def test_cancel_a_scheduled_erasure(compliance_client, make_tenant):
    tenant = make_tenant().tenant
    job = scheduled(tenant)
    page = compliance_client.get(PAGE).content.decode()
    assert f'href="{request_url(tenant.pk)}/cancel"' in page
    confirm = compliance_client.get(request_url(tenant.pk) + "/cancel")
    assert confirm.status_code == 200 and b"Cancel the erasure" in confirm.content
    assert job_of(tenant).state == "scheduled"  # the confirmation step changes nothing
    done = compliance_client.post(request_url(tenant.pk) + "/cancel", follow=True)
    assert "scheduled -&gt; cancelled" in done.content.decode()
    job.refresh_from_db()
    assert job.state == "cancelled"
    [event] = events(AuditAction.ERASURE_CANCELLED, job)
    assert (event.actor_kind, event.actor_id) == ("user", str(compliance_client.user.pk))
    again = compliance_client.post(request_url(tenant.pk) + "/cancel", follow=True)
    assert "was already cancelled; nothing changed" in again.content.decode()
    assert len(events(AuditAction.ERASURE_CANCELLED)) == 1


def test_a_running_erasure_cannot_be_cancelled(compliance_client, make_tenant, make_node):
    tenant = make_tenant().tenant
    job = running(tenant, [make_node()])
    assert "Cancel…" not in compliance_client.get(PAGE).content.decode()
    refused = compliance_client.post(request_url(tenant.pk) + "/cancel")
    assert refused.status_code == 409 and b"erasure_not_cancellable" in refused.content
    job.refresh_from_db()
    assert job.state == "running" and not events(AuditAction.ERASURE_CANCELLED)


# ---- receipt and export ----------------------------------------------------------------------------------------------


def test_receipt_download_verifies(compliance_client, make_tenant):
    tenant = make_tenant().tenant
    job = completed(tenant)
    page = compliance_client.get(PAGE).content.decode()
    assert f'href="{request_url(tenant.pk)}/receipt"' in page and "Receipt verifies" in page
    answer = compliance_client.get(request_url(tenant.pk) + "/receipt")
    assert answer.status_code == 200 and answer["Content-Type"] == "application/json"
    assert answer["Content-Disposition"] == f'attachment; filename="kcaas-erasure-receipt-{job.pk}.json"'
    body = verify(json.loads(answer.content), platform_public_jwk())
    assert body["job_id"] == str(job.pk) and body["tenant_id"] == str(tenant.pk)
    pending = make_tenant().tenant
    scheduled(pending)
    refused = compliance_client.get(request_url(pending.pk) + "/receipt")
    assert refused.status_code == 409 and b"erasure_not_complete" in refused.content


def test_portability_export_download(compliance_client, make_tenant):
    tenant, other = make_tenant().tenant, make_tenant().tenant
    form = compliance_client.get(EXPORT)
    assert form.status_code == 200 and b'<label for="id_tenant">' in form.content
    answer = compliance_client.post(EXPORT, {"tenant": tenant.name})
    assert answer.status_code == 200 and answer["Content-Type"] == "application/json"
    expected = f'attachment; filename="kcaas-export-{tenant.name}-{timezone.now():%Y-%m-%d}.json"'
    assert answer["Content-Disposition"] == expected
    archive = json.loads(answer.content)
    assert archive["format"] == "kcaas.tenant-export" and archive["tenant"]["id"] == str(tenant.pk)
    assert archive["tenant"]["name"] == tenant.name and len(archive["api_keys"]) == 1
    assert other.name not in answer.content.decode()
    [event] = events(AuditAction.DATA_EXPORTED)
    assert (event.actor_kind, event.actor_id, event.tenant_id) == ("user", str(compliance_client.user.pk), tenant.pk)


# ---- roles and bad input ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("role", [roles.OPERATOR, roles.READ_ONLY])
def test_only_compliance_may_act(console_client, make_tenant, role):
    client = console_client(role)
    tenant, other = make_tenant().tenant, make_tenant().tenant
    job = scheduled(other)
    before = AuditEvent.objects.count()
    assert client.get(PAGE).status_code == 200
    for answer in (
        client.post(request_url(tenant.pk), {"confirm": tenant.name}),
        client.post(request_url(other.pk) + "/cancel"),
        client.post(EXPORT, {"tenant": tenant.name}),
        client.get(NEW, {"tenant": tenant.name}),
        client.get(request_url(other.pk) + "/cancel"),
        client.get(request_url(other.pk) + "/receipt"),
    ):
        assert answer.status_code == 403, answer.content[:300]
    assert not ErasureJob.objects.filter(tenant_id=tenant.pk).exists()
    job.refresh_from_db()
    assert job.state == "scheduled" and AuditEvent.objects.count() == before


def test_bad_input_is_a_4xx_and_changes_nothing(compliance_client, make_tenant):
    tenant = make_tenant().tenant
    before = AuditEvent.objects.count()
    for value in ("nobody", "", "x" * 300, UNKNOWN):
        answer = compliance_client.get(NEW, {"tenant": value})
        assert answer.status_code == 400 and b'class="field-error"' in answer.content
    assert compliance_client.post(EXPORT, {"tenant": "nobody"}).status_code == 400
    assert compliance_client.post(EXPORT, {}).status_code == 400
    assert compliance_client.post(request_url(UNKNOWN), {"confirm": "x"}).status_code == 404
    assert compliance_client.post(request_url(tenant.pk) + "/cancel").status_code == 404  # no job to cancel
    assert compliance_client.get(request_url(tenant.pk) + "/receipt").status_code == 404
    for malformed in ("not-a-uuid", "1234", str(uuid.uuid4())[:-1]):
        assert compliance_client.post(request_url(malformed), {"confirm": "x"}).status_code == 404
        assert compliance_client.get(request_url(malformed) + "/receipt").status_code == 404
    assert compliance_client.get(request_url(tenant.pk)).status_code == 405  # a request is a POST
    assert compliance_client.delete(EXPORT).status_code == 405
    assert not ErasureJob.objects.exists() and AuditEvent.objects.count() == before
