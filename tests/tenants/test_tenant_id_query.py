"""Staff name the tenant of a tenant-scoped operation one way: the query parameter `?tenant_id=`, also on
POST /api/v1/keys. The body's `tenant_id` there is still accepted (deprecated, for one release); both given and
different is 400 `tenant_id_conflict`. A tenant key naming another tenant is refused (404) either way."""

import uuid

import pytest

from tenants.models import ApiKey
from tests.controlplane.conftest import schema  # noqa: F401 - the published schema fixture

from .conftest import assert_error, key_client

KEYS_URL = "/api/v1/keys"


def _create(client, *, query=None, body_tenant=None):
    url = KEYS_URL + (f"?tenant_id={query}" if query is not None else "")
    body = {"scopes": ["caches:write"], "name": "ops-made"}
    if body_tenant is not None:
        body["tenant_id"] = body_tenant
    return client.post(url, body, format="json")


def test_staff_create_a_key_naming_the_tenant_in_the_query(staff_client, tenant):
    response = _create(staff_client, query=str(tenant.pk))
    assert response.status_code == 201, response.content
    issued = response.json()
    assert issued["tenant_id"] == str(tenant.pk) and issued["key"].startswith("kc_live_")
    assert key_client(issued["key"]).get("/api/v1/whoami").json()["tenant_id"] == str(tenant.pk)


def test_the_body_form_still_works(staff_client, tenant):
    response = _create(staff_client, body_tenant=str(tenant.pk))
    assert response.status_code == 201 and response.json()["tenant_id"] == str(tenant.pk)


def test_both_forms_agreeing_is_fine(staff_client, tenant):
    response = _create(staff_client, query=str(tenant.pk), body_tenant=str(tenant.pk))
    assert response.status_code == 201 and response.json()["tenant_id"] == str(tenant.pk)


def test_both_forms_differing_is_a_conflict_and_nothing_is_issued(staff_client, make_tenant):
    a, b = make_tenant(), make_tenant()
    error = assert_error(_create(staff_client, query=str(a.pk), body_tenant=str(b.pk)), 400, "tenant_id_conflict")
    assert error["details"] == {"query": str(a.pk), "body": str(b.pk)}
    assert not ApiKey.objects.filter(tenant__in=[a, b]).exists()


@pytest.mark.parametrize("value", ["", "not-a-uuid"])
def test_a_malformed_query_tenant_id_is_a_validation_error(staff_client, tenant, value):
    error = assert_error(_create(staff_client, query=value), 400, "validation_error")
    assert "tenant_id" in error["details"]["fields"]


def test_staff_naming_an_unknown_tenant_get_a_404(staff_client, db):
    assert_error(_create(staff_client, query=str(uuid.uuid4())), 404, "not_found")


@pytest.mark.parametrize("where", ["query", "body"])
def test_a_tenant_key_cannot_cross_to_another_tenant(make_tenant, make_key, where):
    mine, theirs = make_tenant(), make_tenant()
    client = key_client(make_key(mine).raw_key)
    named = {"query": str(theirs.pk)} if where == "query" else {"body_tenant": str(theirs.pk)}
    assert_error(_create(client, **named), 404, "not_found")
    assert not ApiKey.objects.filter(tenant=theirs).exists()
    assert _create(client, query=str(mine.pk)).status_code == 201  # its own tenant, named, is fine


def test_a_tenant_key_naming_its_own_tenant_and_another_is_a_404_not_a_conflict(make_tenant, make_key):
    mine, theirs = make_tenant(), make_tenant()
    client = key_client(make_key(mine).raw_key)
    assert_error(_create(client, query=str(mine.pk), body_tenant=str(theirs.pk)), 404, "not_found")
    assert_error(_create(client, query=str(theirs.pk), body_tenant=str(mine.pk)), 404, "not_found")
    assert_error(_create(client, query=str(theirs.pk), body_tenant=str(theirs.pk)), 404, "not_found")
    assert not ApiKey.objects.filter(tenant=theirs).exists()


def test_staff_scope_a_key_by_the_query_tenant_id(staff_client, make_tenant, make_key):
    a, b = make_tenant(), make_tenant()
    key = make_key(a).api_key
    for suffix in ("", "/revoke"):
        method = staff_client.get if not suffix else staff_client.post
        assert_error(method(f"{KEYS_URL}/{key.pk}{suffix}?tenant_id={b.pk}"), 404, "not_found")
    assert staff_client.get(f"{KEYS_URL}/{key.pk}?tenant_id={a.pk}").status_code == 200
    revoked = staff_client.post(f"{KEYS_URL}/{key.pk}/revoke?tenant_id={a.pk}")
    assert revoked.status_code == 200 and revoked.json()["state"] == "revoked"


def test_a_tenant_key_naming_another_tenant_on_a_key_is_a_404(make_tenant, make_key):
    mine, theirs = make_tenant(), make_tenant()
    own = make_key(mine)
    client = key_client(own.raw_key)
    assert_error(client.get(f"{KEYS_URL}/{own.api_key.pk}?tenant_id={theirs.pk}"), 404, "not_found")
    assert client.get(f"{KEYS_URL}/{own.api_key.pk}?tenant_id={mine.pk}").status_code == 200


def test_the_schema_documents_the_query_form_and_deprecates_the_body_field(schema):
    create = schema["paths"]["/api/v1/keys"]["post"]
    params = {p["name"]: p for p in create["parameters"] if p["in"] == "query"}
    assert "tenant_id" in params and "query parameter" in params["tenant_id"]["description"]
    body_field = schema["components"]["schemas"]["KeyCreateRequest"]["properties"]["tenant_id"]
    assert body_field["deprecated"] is True and "?tenant_id=" in body_field["description"]
    for operation in (create, schema["paths"]["/api/v1/keys"]["get"]):
        source = operation["x-codeSamples"][0]["source"]
        assert "?tenant_id=$TENANT_ID" in source and "-u " in source and "Bearer" in source
    assert '"tenant_id"' not in create["x-codeSamples"][0]["source"]  # the deprecated body form is not shown


def test_staff_name_the_tenant_the_same_way_on_the_routing_endpoints(staff_client, make_tenant):
    from tests.routing.conftest import engine_body

    acme, other = make_tenant(), make_tenant()
    error = assert_error(staff_client.get("/api/v1/engines"), 400, "tenant_required")
    assert "?tenant_id=" in error["message"]
    made = staff_client.post(f"/api/v1/engines?tenant_id={acme.pk}", engine_body("gpu-0"), format="json")
    assert made.status_code == 201, made.content
    listed = staff_client.get(f"/api/v1/engines?tenant_id={acme.pk}").json()
    assert [engine["name"] for engine in listed] == ["gpu-0"]
    assert staff_client.get(f"/api/v1/engines?tenant_id={other.pk}").json() == []  # another tenant's: not there
    instance = made.json()["id"]
    assert staff_client.get(f"/api/v1/engines/{instance}?tenant_id={other.pk}").status_code == 404
