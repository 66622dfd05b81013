"""GET /api/v1/usage: the tenant's limits next to what its caches and tokens consume, only its own, never anonymous."""

import uuid

import pytest
from rest_framework.test import APIClient

from caches.models import Cache
from tests.caches.conftest import BLOCK_BYTES, GIB, attach_body, make_ready, purge_node_queue

pytestmark = pytest.mark.django_db

URL = "/api/v1/usage"


@pytest.fixture
def node(make_node):
    made = make_node()
    yield made
    purge_node_queue(made.pk)  # the provisioning messages the attaches sent


def _attach(handle, name, **capacity) -> str:
    response = handle.client.post("/api/v1/caches", attach_body(name=name, **capacity), format="json")
    assert response.status_code == 201, response.content
    return response.json()["id"]


def _usage(client, **query) -> dict:
    response = client.get(URL, query)
    assert response.status_code == 200, response.content
    return response.json()


def _error(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.content
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "details"}
    assert body["error"]["code"] == code, body
    return body["error"]


def test_a_new_tenant_sees_its_effective_limits_and_nothing_used(make_tenant, settings):
    handle = make_tenant(max_caches=3, max_device_bytes=GIB)
    body = _usage(handle.client)
    defaults = settings.KCAAS_QUOTA_DEFAULTS
    assert body["tenant_id"] == str(handle.tenant.pk)
    assert body["limits"] == {
        "max_caches": 3,
        "max_device_bytes": GIB,
        "max_dram_bytes": defaults["max_dram_bytes"],
        "max_ssd_bytes": defaults["max_ssd_bytes"],
        "max_network_bytes": defaults["max_network_bytes"],
        "max_requests_per_second": 100_000,
        "max_data_tokens_outstanding": defaults["max_data_tokens_outstanding"],
        "max_api_keys": defaults["max_api_keys"],
    }
    zero = {"device_bytes": 0, "dram_bytes": 0, "ssd_bytes": 0, "network_bytes": 0}
    assert body["used"] == {"caches": 0, **zero, "data_tokens_outstanding": 0, "api_keys": 1}  # the key asking
    assert body["resident"] == zero


def test_used_counts_non_detached_caches_their_capacity_and_live_tokens(tenant_a, node):
    ready = _attach(tenant_a, "ready", device=64 * BLOCK_BYTES, dram=128 * BLOCK_BYTES)
    _attach(tenant_a, "provisioning", device=32 * BLOCK_BYTES, ssd=16 * BLOCK_BYTES)
    gone = _attach(tenant_a, "gone", device=8 * BLOCK_BYTES)
    make_ready(ready)
    for _ in range(2):
        issued = tenant_a.client.post(f"/api/v1/caches/{ready}/tokens", {"access": "read"}, format="json")
        assert issued.status_code == 201, issued.content
    assert tenant_a.client.delete(f"/api/v1/caches/{gone}").status_code == 202  # detaching still counts
    Cache.objects.filter(pk=gone).update(state="detached")  # as the node's detach answer leaves it

    used = _usage(tenant_a.client)["used"]
    assert used == {
        "caches": 2,
        "device_bytes": 96 * BLOCK_BYTES,
        "dram_bytes": 128 * BLOCK_BYTES,
        "ssd_bytes": 16 * BLOCK_BYTES,
        "network_bytes": 0,
        "data_tokens_outstanding": 2,
        "api_keys": 1,
    }


def test_resident_sums_the_nodes_snapshots_for_the_tenants_caches_only(tenant_a, tenant_b, node):
    from fleet import services as fleet_services

    mine, theirs = _attach(tenant_a, "a1"), _attach(tenant_b, "b1")
    fleet_services.node_heartbeat(
        node_id=node.pk,
        capacity={"device": 8 * GIB, "dram": 64 * GIB, "ssd": 512 * GIB},
        resident=[
            {"cache_id": mine, "device_bytes": 10 * BLOCK_BYTES, "dram_bytes": 3 * BLOCK_BYTES, "network_bytes": 5},
            {"cache_id": theirs, "device_bytes": 7 * BLOCK_BYTES},
            {"cache_id": str(uuid.uuid4()), "device_bytes": 999},  # a cache the control plane does not know
        ],
    )
    assert _usage(tenant_a.client)["resident"] == {
        "device_bytes": 10 * BLOCK_BYTES,
        "dram_bytes": 3 * BLOCK_BYTES,
        "ssd_bytes": 0,
        "network_bytes": 5,
    }
    assert _usage(tenant_b.client)["resident"] == {
        "device_bytes": 7 * BLOCK_BYTES,
        "dram_bytes": 0,
        "ssd_bytes": 0,
        "network_bytes": 0,
    }


def test_each_tenant_sees_only_its_own_numbers(tenant_a, tenant_b, node):
    _attach(tenant_a, "a1", device=64 * BLOCK_BYTES)
    _attach(tenant_a, "a2", device=64 * BLOCK_BYTES)
    _attach(tenant_b, "b1", device=16 * BLOCK_BYTES)

    a, b = _usage(tenant_a.client), _usage(tenant_b.client)
    assert (a["tenant_id"], a["used"]["caches"], a["used"]["device_bytes"]) == (
        str(tenant_a.tenant.pk),
        2,
        128 * BLOCK_BYTES,
    )
    assert (b["tenant_id"], b["used"]["caches"], b["used"]["device_bytes"]) == (
        str(tenant_b.tenant.pk),
        1,
        16 * BLOCK_BYTES,
    )
    # naming another tenant is a 404, like every other tenant-confined read
    _error(tenant_a.client.get(URL, {"tenant_id": str(tenant_b.tenant.pk)}), 404, "not_found")
    assert _usage(tenant_a.client, tenant_id=str(tenant_a.tenant.pk))["used"]["caches"] == 2


def test_unauthenticated_is_401_not_authenticated_and_a_bad_key_is_401_invalid_api_key(db):
    _error(APIClient().get(URL), 401, "not_authenticated")
    forged = APIClient()
    forged.credentials(HTTP_AUTHORIZATION=f"Bearer kc_live_{'a' * 12}_{'b' * 43}")
    response = forged.get(URL)
    assert response.status_code == 401 and response.json()["error"]["code"] in {"invalid_api_key", "malformed_api_key"}


@pytest.mark.parametrize("scope", ["caches:read", "caches:write", "usage:read", "usage:write"])
def test_caches_or_usage_read_is_enough(tenant_a, scope):
    assert _usage(tenant_a.key(scope))["tenant_id"] == str(tenant_a.tenant.pk)


def test_a_key_without_caches_or_usage_scope_is_403_naming_caches_read(tenant_a):
    error = _error(tenant_a.key("keys:write").get(URL), 403, "permission_denied")
    assert error["details"] == {"required_scope": "caches:read"}


def test_staff_name_the_tenant(staff_client, tenant_a, node):
    _attach(tenant_a, "a1")
    _error(staff_client.get(URL), 400, "tenant_required")
    body = _usage(staff_client, tenant_id=str(tenant_a.tenant.pk))
    assert body["tenant_id"] == str(tenant_a.tenant.pk) and body["used"]["caches"] == 1
    _error(staff_client.get(URL, {"tenant_id": str(uuid.uuid4())}), 404, "not_found")


def test_the_operation_is_in_the_openapi_schema(client):
    schema = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    operation = schema["paths"]["/api/v1/usage"]["get"]
    assert operation["operationId"] == "usage_retrieve"
    assert {"200", "401", "403", "404", "429"} <= set(operation["responses"])
    usage = schema["components"]["schemas"]["Usage"]
    assert set(usage["properties"]) == {"tenant_id", "limits", "used", "resident", "over_quota", "over_quota_limits"}
