"""The API's front door: GET /api/v1/ lists every resource and links the reference without credentials; /api/ and
/ send a caller somewhere useful; any other unknown path under /api/ is a JSON 404 `not_found`."""

import pytest
from django.test import Client

from tests.controlplane.test_errors_and_schema import assert_error

HTTP_METHODS = {"get", "post", "put", "patch", "delete"}


@pytest.fixture(scope="module")
def schema():
    return Client().get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()


@pytest.fixture
def root():
    response = Client().get("/api/v1/")
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("application/json")
    return response.json()


def test_the_root_needs_no_credentials_and_links_the_reference(root):
    assert root["name"] == "KCaaS control plane API"
    assert root["reference"] == {
        "schema_url": "http://testserver/api/schema/",
        "docs_url": "http://testserver/api/docs/",
        "swagger_url": "http://testserver/api/docs/swagger/",
    }
    assert Client().get(root["reference"]["schema_url"]).status_code == 200
    assert Client().get(root["reference"]["docs_url"]).status_code == 200


def test_the_root_lists_every_documented_operation_once_by_resource(root, schema):
    listed = {(op["method"], op["path"]) for resource in root["resources"] for op in resource["operations"]}
    documented = {
        (method.upper(), path) for path, item in schema["paths"].items() for method in item if method in HTTP_METHODS
    }
    assert listed == documented
    names = [resource["name"] for resource in root["resources"]]
    assert names[0] == "caches" and names == [tag["name"] for tag in schema["tags"]]


def test_each_resource_has_a_name_url_description_and_methods(root):
    caches = next(resource for resource in root["resources"] if resource["name"] == "caches")
    assert caches["url"] == "http://testserver/api/v1/caches"
    assert caches["methods"] == ["GET", "POST", "DELETE"]
    assert caches["description"]
    for resource in root["resources"]:
        assert resource["url"].startswith("http://testserver/") and resource["description"] and resource["methods"]
        assert all(op["summary"] for op in resource["operations"]), resource["name"]


def test_api_and_the_unslashed_root_redirect_to_the_root():
    for path in ("/api/", "/api/v1"):
        response = Client().get(path)
        assert response.status_code == 308 and response["Location"] == "/api/v1/"


def test_the_site_root_sends_a_browser_to_the_console_and_a_client_to_the_api():
    browser = Client().get("/", HTTP_ACCEPT="text/html,application/xhtml+xml")
    assert browser.status_code == 302 and browser["Location"] == "/console/"
    for accept in ("application/json", "*/*"):
        client = Client().get("/", HTTP_ACCEPT=accept)
        assert client.status_code == 302 and client["Location"] == "/api/v1/"


@pytest.mark.parametrize("path", ["/api/v1/nope", "/api/v2/", "/api/v1/caches/x/y/z", "/api/nothing", "/api/v1/cache"])
def test_unknown_api_paths_are_a_json_404_pointing_at_the_root(path):
    error = assert_error(Client().get(path), 404, "not_found")
    assert "/api/v1/" in error["message"]
    assert error["details"] == {"api_root": "http://testserver/api/v1/"}


def test_an_unknown_path_with_a_routed_slashed_form_redirects_there():
    response = Client().get("/api/docs")
    assert response.status_code == 301 and response["Location"] == "/api/docs/"


def test_the_root_refuses_writes_with_a_json_405():
    response = Client().post("/api/v1/", {})
    assert_error(response, 405, "method_not_allowed")
    assert response["Allow"] == "GET, HEAD"


def test_a_write_to_an_unknown_api_path_is_the_json_404_not_a_csrf_page():
    client = Client(enforce_csrf_checks=True)
    assert_error(client.post("/api/v1/admin/nodes/%3E/cordon", {}), 404, "not_found")
    assert_error(client.post("/api/v1/", {}), 405, "method_not_allowed")
