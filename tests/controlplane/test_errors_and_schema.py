"""The one error shape and the published OpenAPI schema, for routes that no room owns."""

import pytest
from django.test import Client


@pytest.fixture
def client():
    return Client()


def assert_error(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.content
    assert response["Content-Type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "details"}
    assert body["error"]["code"] == code
    return body["error"]


def test_unknown_url_is_a_json_404(client):
    assert_error(client.get("/no/such/page"), 404, "not_found")


def test_health_needs_no_credentials(client):
    response = client.get("/healthz")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_the_schema_is_openapi_3_and_names_the_api(client):
    response = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    schema = response.json()
    assert schema["openapi"].startswith("3.")
    assert schema["info"]["title"] == "KCaaS control plane API"


def test_the_docs_page_is_served_without_a_cdn(client):
    response = client.get("/api/docs/")
    assert response.status_code == 200
    page = response.content.decode()
    assert "redoc" in page.lower() and "cdn.jsdelivr" not in page


def test_staff_operations_publish_the_basic_scheme_and_no_session_cookie(client):
    """The REST API's staff authentication classes narrow DRF's (console users refused); the schema names the basic
    scheme on staff operations (clients and the schema fuzzers keep the staff way in), never the session cookie
    (the console's sessions are the only ones issued, and the API refuses them: tests/controlplane/
    test_api_reference.py), and no API key where staff alone are allowed."""
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    assert "basicAuth" in schema["components"]["securitySchemes"]
    assert "cookieAuth" not in schema["components"]["securitySchemes"]
    assert schema["paths"]["/api/v1/admin/tenants"]["get"]["security"] == [{"basicAuth": []}]


@pytest.mark.django_db
def test_an_undocumented_query_parameter_is_a_400_naming_it(client):
    """The schema is the contract for query strings as for bodies: a typo is refused, not silently ignored."""
    from django.contrib.auth import get_user_model

    staff = get_user_model().objects.create_user("ops-query", is_staff=True)
    client.force_login(staff)
    assert client.get("/api/v1/admin/tenants", {"limit": 5}).status_code == 200
    refused = client.get("/api/v1/admin/tenants", {"limt": 5, "": "x"})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "validation_error"
    assert error["details"]["fields"] == {"": ["Unknown query parameter."], "limt": ["Unknown query parameter."]}
    assert client.get("/api/v1/admin/nodes", {"state": "ready", "offset": 0}).status_code == 200
    assert client.get("/healthz", {"anything": 1}).status_code == 200  # outside /api/v1/: not the API's contract
