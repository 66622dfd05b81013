"""The caches operations take what their published schema says, no more: JSON integers where it says integer ("2"
and 2.0 are refused, naming the field), no properties beyond the declared ones in the body, its `spec` and its
`capacity` (the schema says additionalProperties: false for each). The data token, a secret, is never stored by a
cache on the way."""

import pytest

from caches.models import Cache
from tests.caches.conftest import BLOCK_BYTES, attach_body, make_ready

pytestmark = pytest.mark.django_db
URL = "/api/v1/caches"


def _error(response, status, code) -> dict:
    assert response.status_code == status, (response.status_code, response.content)
    body = response.json()
    assert set(body) == {"error"} and body["error"]["code"] == code, body
    return body["error"]


def _post(client, body, url=URL):
    return client.post(url, body, format="json")


@pytest.mark.parametrize("value", ["131072", 131072.0, 1.31072e5, True])
@pytest.mark.parametrize("tier", ["device", "dram", "ssd"])
def test_a_capacity_that_is_not_a_json_integer_is_refused_naming_the_tier(tenant_a, node, tier, value):
    body = attach_body()
    body["capacity"][tier] = value
    error = _error(_post(tenant_a.client, body), 400, "invalid_capacity")
    assert list(error["details"]["fields"]["capacity"]) == [tier]
    assert not Cache.objects.exists()


@pytest.mark.parametrize("value", ["2", 2.0])
@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim", "block_size"])
def test_a_spec_shape_that_is_not_a_json_integer_is_refused_naming_the_field(tenant_a, node, field, value):
    error = _error(_post(tenant_a.client, attach_body(**{field: value})), 400, "invalid_spec")
    assert list(error["details"]["fields"]["spec"]) == [field]


@pytest.mark.parametrize(
    ("body_change", "where", "code"),
    [
        (lambda body: body["spec"].update(rope_theta=10000), "spec", "invalid_spec"),
        (lambda body: body["capacity"].update(hbm=BLOCK_BYTES), "capacity", "invalid_capacity"),
        (lambda body: body.update(owner="someone-else"), None, "validation_error"),
    ],
    ids=["spec", "capacity", "top-level"],
)
def test_an_undeclared_property_is_refused_naming_it(tenant_a, node, body_change, where, code):
    body = attach_body()
    body_change(body)
    fields = _error(_post(tenant_a.client, body), 400, code)["details"]["fields"]
    assert (fields[where] if where else fields) == {
        "spec": {"rope_theta": ["Unknown field."]},
        "capacity": {"hbm": ["Unknown field."]},
        None: {"owner": ["Unknown field."]},
    }[where]
    assert not Cache.objects.exists()


def test_the_schema_says_what_the_validators_enforce(client):
    schemas = client.get("/api/schema/?format=json").json()["components"]["schemas"]
    for name in ("CacheAttachInputRequest", "SpecRequest", "CapacityRequest", "DataTokenIssueInputRequest"):
        assert schemas[name]["additionalProperties"] is False, name
    attach = schemas["CacheAttachInputRequest"]["properties"]
    assert attach["spec"] == {"$ref": "#/components/schemas/SpecRequest"}
    assert attach["capacity"] == {"$ref": "#/components/schemas/CapacityRequest"}
    assert schemas["CapacityRequest"]["properties"]["device"]["type"] == "integer"
    assert schemas["DataTokenIssueInputRequest"]["properties"]["ttl_seconds"]["type"] == "integer"


def test_a_valid_attach_still_passes(tenant_a, node):
    assert _post(tenant_a.client, attach_body()).status_code == 201


# ---- data tokens ----------------------------------------------------------------------------------------------------


@pytest.fixture
def ready_cache(tenant_a, node) -> Cache:
    response = _post(tenant_a.client, attach_body())
    assert response.status_code == 201, response.content
    return make_ready(response.json()["id"])


@pytest.mark.parametrize("body", [{"ttl_seconds": "600"}, {"ttl_seconds": 600.0}, {"access": "read", "aud": "x"}])
def test_a_token_request_off_the_schema_is_refused(tenant_a, ready_cache, body):
    error = _error(_post(tenant_a.client, body, f"{URL}/{ready_cache.pk}/tokens"), 400, "validation_error")
    assert list(error["details"]["fields"]) == [next(iter(set(body) - {"access"}))]


def test_the_data_token_answer_is_no_store(tenant_a, ready_cache):
    response = _post(tenant_a.client, {"ttl_seconds": 600}, f"{URL}/{ready_cache.pk}/tokens")
    assert response.status_code == 201 and response.json()["token"]
    assert response["Cache-Control"] == "no-store"
