"""The API reference is complete and honest: every operation has a summary, a description and a curl sample (and
request/response examples, for the operations listed in EXAMPLED); it names only the authentication schemes that
the live API accepts, which the tests here check by calling it."""

import base64

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from rest_framework.test import APIClient

from console import access
from tenants import services
from tenants.scopes import ALL_SCOPES

HTTP_METHODS = {"get", "post", "put", "patch", "delete"}
ACCEPTED_SCHEMES = {"ApiKeyAuth", "basicAuth", "NodeCredential"}
# Operations whose request (when they take a body) and response carry a real example; grows to every operation.
EXAMPLED = {
    "caches_list",
    "caches_attach",
    "caches_retrieve",
    "caches_detach",
    "caches_recover",
    "caches_tokens_create",
    "caches_tokens_revoke",
    "caches_tokens_revoke_all",
    "keys_list",
    "keys_create",
    "keys_retrieve",
    "keys_revoke",
    "keys_rotate",
    "whoami",
    "engines_list",
    "engines_register",
    "engines_retrieve",
    "engines_deregister",
    "engines_lookup",
    "usage_retrieve",
    "admin_tenants_list",
    "admin_tenants_create",
    "admin_tenants_retrieve",
    "admin_tenants_update_status",
    "admin_tenants_quota_retrieve",
    "admin_tenants_quota_update",
    "jwks",
    "platform_key",
    "admin_nodes_list",
    "admin_nodes_create",
    "admin_nodes_retrieve",
    "admin_nodes_cordon",
    "admin_nodes_uncordon",
    "invoices_list",
    "invoices_retrieve",
    "admin_rates_list",
    "admin_rates_create",
}


def _operations(schema):
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            if method in HTTP_METHODS:
                yield path, method, operation


def test_every_operation_has_a_summary_and_a_description(schema):
    missing = [
        op["operationId"] for _, _, op in _operations(schema) if not op.get("summary") or not op.get("description")
    ]
    assert missing == []
    summaries = [op["summary"] for _, _, op in _operations(schema)]
    assert len(summaries) == len(set(summaries))  # Redoc's sidebar tells them apart


def test_every_operation_has_a_curl_sample_with_its_credentials(schema):
    for _path, method, operation in _operations(schema):
        samples = operation.get("x-codeSamples", [])
        assert [sample["label"] for sample in samples] == ["curl"], operation["operationId"]
        source = samples[0]["source"]
        assert source.startswith("curl ") and "$KCAAS_URL" in source and "{" not in source.split("\n")[0]
        schemes = {name for requirement in operation.get("security", []) for name in requirement}
        if schemes:
            assert "Authorization: Bearer" in source or "-u " in source, operation["operationId"]
        if method in {"post", "put", "patch"} and operation.get("requestBody") and operation["operationId"] in EXAMPLED:
            assert "-d '" in source, operation["operationId"]


@pytest.mark.parametrize("operation_id", sorted(EXAMPLED))
def test_the_exampled_operations_have_request_and_response_examples(schema, operation_id):
    operation = next(op for _, _, op in _operations(schema) if op["operationId"] == operation_id)
    body = operation.get("requestBody", {}).get("content", {}).get("application/json")
    if body is not None:
        assert body.get("examples"), "request example"
    success = next(response for code, response in operation["responses"].items() if code.startswith("2"))
    content = success.get("content", {})
    if content:
        assert any(media.get("examples") for media in content.values()), "response example"


def test_the_key_example_is_a_well_formed_key(schema):
    from core.keys import is_well_formed

    for operation in (schema["paths"]["/api/v1/keys"]["post"], schema["paths"]["/api/v1/keys/{key_id}/rotate"]["post"]):
        issued = next(iter(operation["responses"]["201"]["content"]["application/json"]["examples"].values()))
        assert is_well_formed(issued["value"]["key"])


def test_the_schema_names_only_schemes_the_api_accepts(schema):
    assert set(schema["components"]["securitySchemes"]) == ACCEPTED_SCHEMES  # no session cookie
    for _, _, operation in _operations(schema):
        for requirement in operation.get("security", []):
            assert set(requirement) <= ACCEPTED_SCHEMES


def _staff_only_gets(schema):
    """Staff-only GET operations without path parameters: the schema names basicAuth alone."""
    for path, method, operation in _operations(schema):
        schemes = [name for requirement in operation.get("security", []) for name in requirement]
        if method == "get" and schemes == ["basicAuth"] and "{" not in path:
            yield path


@pytest.mark.django_db
def test_an_api_key_is_refused_where_the_schema_names_basic_alone(schema):
    tenant = services.tenant_create(name="reference-acme")
    key = services.api_key_issue(tenant=tenant, scopes=list(ALL_SCOPES))
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key.raw_key}")
    paths = list(_staff_only_gets(schema))
    assert "/api/v1/admin/tenants" in paths
    for path in paths:
        assert client.get(path).status_code == 403, path
    assert client.get("/api/v1/caches").status_code == 200  # and accepted where the schema names it


@pytest.mark.django_db
def test_basic_works_for_an_administrator_and_the_console_session_is_refused(schema):
    admin = get_user_model().objects.create_user("reference-admin", password="pw-reference-1", is_staff=True)
    basic = "Basic " + base64.b64encode(b"reference-admin:pw-reference-1").decode()
    assert Client().get("/api/v1/admin/tenants", HTTP_AUTHORIZATION=basic).status_code == 200
    console = Client()
    console.force_login(admin)
    session = console.session
    session[access.SESSION_FLAG] = True  # what the console's sign-in sets: the only sessions this product issues
    session.save()
    for path in ("/api/v1/admin/tenants", "/api/v1/caches", "/api/v1/whoami"):
        assert console.get(path).status_code in (401, 403), path
