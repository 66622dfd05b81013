"""The audit API: who reads what (staff all, tenant keys with audit:read their own, others 403 with a code),
filters and their refusals, exports that verify and are themselves audited, digests, the public platform key,
and the published schema."""

import uuid

import pytest
from rest_framework.test import APIClient

from audit import chain
from audit.actions import AuditAction
from audit.keys import platform_public_jwk
from audit.models import AuditEvent

from .events_support import issue_key, make_tenant, staff  # noqa: F401  (fixtures)
from .helpers import next_second

pytestmark = pytest.mark.django_db(transaction=True)
EVENTS, EXPORT, DIGESTS = "/api/v1/audit/events", "/api/v1/audit/export", "/api/v1/audit/digests"


@pytest.fixture
def two_tenants(make_tenant):
    reader = make_tenant(scopes=("audit:read", "keys:write"))
    other = make_tenant(scopes=("audit:read",))
    blind = issue_key(reader.tenant, ["caches:read"])
    return reader, other, blind


def error_code(response, status: int) -> dict:
    assert response.status_code == status, response.content
    return response.json()["error"]


def tenants_in(response) -> set[str | None]:
    assert response.status_code == 200, response.content
    return {event["tenant_id"] for event in response.json()["results"]}


def streamed(response) -> list[str]:
    assert response.status_code == 200, getattr(response, "content", b"")
    return [line for chunk in response.streaming_content for line in chunk.decode().splitlines(keepends=True)]


def test_a_tenant_key_reads_only_its_own_tenants_events(two_tenants):
    reader, other, _ = two_tenants
    assert tenants_in(reader.client.get(EVENTS)) == {str(reader.tenant.pk)}
    assert tenants_in(other.client.get(EVENTS)) == {str(other.tenant.pk)}
    assert tenants_in(reader.client.get(EVENTS, {"tenant_id": str(reader.tenant.pk)})) == {str(reader.tenant.pk)}
    assert error_code(reader.client.get(EVENTS, {"tenant_id": str(other.tenant.pk)}), 404)["code"] == "not_found"


def test_a_key_without_audit_read_is_refused_with_the_scope_it_lacks(two_tenants):
    _, _, blind = two_tenants
    for path in (EVENTS, EXPORT):
        error = error_code(blind.client.get(path), 403)
        assert error["code"] == "permission_denied" and error["details"]["required_scope"] == "audit:read"
    assert error_code(blind.client.get(DIGESTS), 403)["code"] == "permission_denied"
    assert error_code(APIClient().get(EVENTS), 401)["code"] == "not_authenticated"


def test_staff_read_everything_and_filter(two_tenants, staff):
    reader, other, _ = two_tenants
    assert {str(reader.tenant.pk), str(other.tenant.pk)} <= tenants_in(staff.client.get(EVENTS, {"limit": 500}))
    assert tenants_in(staff.client.get(EVENTS, {"tenant_id": str(other.tenant.pk)})) == {str(other.tenant.pk)}
    issued = AuditEvent.objects.filter(action=AuditAction.KEY_ISSUED)
    body = staff.client.get(EVENTS, {"action": int(AuditAction.KEY_ISSUED), "limit": 500}).json()
    assert body["count"] == issued.count() and {e["action_name"] for e in body["results"]} == {"key.issued"}
    first = AuditEvent.objects.order_by("seq").first()
    actor = f"{first.actor_kind}:{first.actor_id}" if first.actor_id else first.actor_kind
    by_actor = staff.client.get(EVENTS, {"actor": actor, "limit": 500}).json()["results"]
    assert by_actor and {(e["actor_kind"], e["actor_id"]) for e in by_actor} == {(first.actor_kind, first.actor_id)}
    window = {"from": first.occurred_at.isoformat(), "to": AuditEvent.objects.last().occurred_at.isoformat()}
    seqs = [e["seq"] for e in staff.client.get(EVENTS, {**window, "limit": 500}).json()["results"]]
    assert seqs == list(range(first.seq, AuditEvent.objects.last().seq))  # [from, to)


@pytest.mark.parametrize(
    "params, code",
    [
        ({"from": "2030-01-01T00:00:00Z", "to": "2029-01-01T00:00:00Z"}, "invalid_range"),
        ({"action": "99999"}, "validation_error"),
        ({"actor": "robot:1"}, "validation_error"),
        ({"from": "yesterday"}, "validation_error"),
        ({"tenant_id": "not-a-uuid"}, "validation_error"),
        ({"limit": "0"}, "validation_error"),
    ],
)
def test_bad_filters_are_400_with_a_code(staff, params, code):
    assert error_code(staff.client.get(EVENTS, params), 400)["code"] == code


def test_a_staff_export_verifies_and_is_itself_audited(two_tenants, staff):
    lines = streamed(staff.client.get(EXPORT, {"format": "jsonl"}))
    report = chain.verify_export(lines, trusted_key_jwk=platform_public_jwk())
    assert report.ok and report.events == AuditEvent.objects.count() - 1, report.summary()  # not its own event
    exported = AuditEvent.objects.order_by("seq").last()
    assert exported.action == AuditAction.AUDIT_EXPORTED and exported.actor_kind == "user"
    assert exported.new_values["format"] == "jsonl" and exported.new_values["tenant_id"] is None
    response = staff.client.get(EXPORT, {"format": "csv", "tenant_id": str(two_tenants[1].tenant.pk)})
    assert response["Content-Type"].startswith("text/csv") and "attachment" in response["Content-Disposition"]
    assert chain.verify_export(streamed(response)).ok


def test_a_tenant_export_holds_its_events_and_only_witnesses_of_others(two_tenants):
    reader, other, _ = two_tenants
    response = reader.client.get(EXPORT, {"format": "csv", "tenant_id": str(reader.tenant.pk)})
    text = "".join(streamed(response))
    assert str(other.tenant.pk) not in text and str(reader.tenant.pk) in text
    report = chain.verify_export(text.splitlines(keepends=True))
    assert report.ok and report.witnesses > 0, report.summary()
    exported = AuditEvent.objects.order_by("seq").last()
    assert (exported.action, exported.tenant_id) == (AuditAction.AUDIT_EXPORTED, reader.tenant.pk)
    assert exported.new_values["format"] == "csv" and exported.actor_id == reader.api_key.public_id
    assert error_code(reader.client.get(EXPORT, {"tenant_id": str(other.tenant.pk)}), 404)["code"] == "not_found"
    assert error_code(reader.client.get(EXPORT, {"format": "xml"}), 400)["code"] == "validation_error"


def test_staff_list_digests(staff, settings):
    from audit.digests import audit_digest_sign

    settings.KCAAS_AUDIT_DIGEST_SECONDS = 1
    next_second()
    signed = audit_digest_sign()
    results = staff.client.get(DIGESTS).json()["results"]
    assert [d["digest_hash"] for d in results] == [d.digest_hash for d in signed]
    assert results[0]["key_id"] == platform_public_jwk()["kid"]


def test_the_platform_key_is_public():
    response = APIClient().get("/.well-known/kcaas-platform-key.json")
    assert response.status_code == 200 and response.json() == platform_public_jwk()


def test_the_schema_publishes_the_audit_operations(staff):
    schema = APIClient().get("/api/schema/?format=json").json()
    operations = {op["operationId"]: (path, op) for path, item in schema["paths"].items() for op in item.values()}
    for operation_id in ("audit_events_list", "audit_export", "audit_digests_list", "platform_key"):
        assert operation_id in operations
    export = operations["audit_export"][1]
    assert set(export["responses"]["200"]["content"]) == {"application/x-ndjson", "text/csv"}
    assert operations["audit_events_list"][0] == "/api/v1/audit/events"
    assert "AuditEvent" in schema["components"]["schemas"] and uuid
