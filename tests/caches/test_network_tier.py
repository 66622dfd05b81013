"""The network tier at attach: capacity.network is a share of the fleet's network store (KCAAS_NETWORK_STORE_BYTES),
not a node's bytes; network_write_through is a validated per-cache option the node is told; quota counts it."""

import pytest

from caches import services
from caches.models import Cache, CacheState
from fleet.models import Node
from kcaas.node_protocol.messages import PROVISION_TASK
from tests.caches.conftest import BLOCK_BYTES, SPEC, reserved
from tests.fleet.node_keys import opened

pytestmark = pytest.mark.django_db

URL = "/api/v1/caches"
STORE = 10 * BLOCK_BYTES


def body(name="n1", *, network=0, write_through=None, device=4 * BLOCK_BYTES, **capacity) -> dict:
    made = {"name": name, "spec": SPEC, "capacity": {"device": device, "network": network, **capacity}}
    if write_through is not None:
        made["network_write_through"] = write_through
    return made


def _post(handle, made):
    return handle.client.post(URL, made, format="json")


def _error(response, status, code) -> dict:
    assert response.status_code == status, response.content
    assert response.json()["error"]["code"] == code, response.content
    return response.json()["error"]


@pytest.fixture
def store(settings):
    settings.KCAAS_NETWORK_STORE_BYTES = STORE
    return STORE


def test_without_a_network_store_network_bytes_are_409_network_tier_absent(tenant_a, node, settings):
    settings.KCAAS_NETWORK_STORE_BYTES = 0
    error = _error(_post(tenant_a, body(network=BLOCK_BYTES)), 409, "network_tier_absent")
    assert "KCAAS_NETWORK_STORE_BYTES" in error["details"]["hint"]
    assert not Cache.objects.exists() and reserved(node) == {"device": 0, "dram": 0, "ssd": 0}
    made = _post(tenant_a, body(network=0))  # no network bytes: no network tier needed
    assert made.status_code == 201 and made.json()["capacity"]["network"] == 0
    assert made.json()["network_write_through"] is False


def test_network_bytes_are_shown_told_to_the_node_and_never_reserved_on_it(tenant_a, node, store):
    response = _post(tenant_a, body(network=4 * BLOCK_BYTES, write_through=True))
    assert response.status_code == 201, response.content
    shown = response.json()
    assert shown["capacity"] == {"device": 4 * BLOCK_BYTES, "dram": 0, "ssd": 0, "network": 4 * BLOCK_BYTES}
    assert shown["network_write_through"] is True
    assert reserved(node) == {"device": 4 * BLOCK_BYTES, "dram": 0, "ssd": 0}  # placement ignores network
    cache = Cache.objects.get(pk=shown["id"])
    order = services.provision_order_message(str(cache.pk), cache.epoch)
    assert order is not None and order.capacity["network"] == 4 * BLOCK_BYTES and order.network_write_through
    # the cache's data key names and seals its objects: sent even without an SSD tier
    ssd_key = opened(order.ssd_key_box, task=PROVISION_TASK, node_id=node.pk, cache_id=cache.pk, field="ssd_key")
    assert len(ssd_key) == 32
    assert tenant_a.client.get(f"{URL}/{cache.pk}").json()["network_write_through"] is True


def test_a_node_without_free_bytes_is_not_needed_for_network_bytes(tenant_a, make_node, store):
    small = make_node(device=4 * BLOCK_BYTES, dram=0, ssd=0)
    assert _post(tenant_a, body(network=STORE)).status_code == 201
    assert Cache.objects.get().node_id == small.pk


def test_past_the_store_is_503_no_capacity_with_largest_free_and_detach_gives_it_back(tenant_a, tenant_b, node, store):
    first = _post(tenant_a, body("a", network=6 * BLOCK_BYTES)).json()
    error = _error(_post(tenant_b, body("b", network=5 * BLOCK_BYTES)), 503, "no_capacity")
    assert error["details"]["largest_free"] == {"network": 4 * BLOCK_BYTES}
    assert error["details"]["requested"] == {"network": 5 * BLOCK_BYTES}
    assert "KCAAS_NETWORK_STORE_BYTES" in error["details"]["hint"]
    assert _post(tenant_b, body("b", network=4 * BLOCK_BYTES)).status_code == 201  # exactly what is left
    Cache.objects.filter(pk=first["id"]).update(state=CacheState.FAILED)  # a failed cache keeps its share
    _error(_post(tenant_b, body("c", network=BLOCK_BYTES)), 503, "no_capacity")
    assert tenant_a.client.delete(f"{URL}/{first['id']}").status_code == 200  # failed -> detached at once
    assert _post(tenant_b, body("c", network=6 * BLOCK_BYTES)).status_code == 201


@pytest.mark.parametrize(
    "made, code, field",
    [
        (body(write_through=True), "invalid_capacity", "network_write_through"),  # no network bytes
        (body(network=BLOCK_BYTES, write_through="yes"), "validation_error", "network_write_through"),
        (body(network=BLOCK_BYTES, write_through=1), "validation_error", "network_write_through"),
        (body(network=BLOCK_BYTES // 2), "invalid_capacity", "capacity"),  # under one block
        (body(network=-1), "invalid_capacity", "capacity"),
        (body(network="1GiB"), "invalid_capacity", "capacity"),
    ],
)
def test_bad_network_options_are_400_naming_the_field(tenant_a, node, store, made, code, field):
    error = _error(_post(tenant_a, made), 400, code)
    assert field in error["details"]["fields"], error
    assert not Cache.objects.exists()


def test_network_bytes_are_limited_by_the_tenants_quota(make_tenant, node, store):
    tenant = make_tenant(max_network_bytes=5 * BLOCK_BYTES)
    assert _post(tenant, body("a", network=3 * BLOCK_BYTES)).status_code == 201
    error = _error(_post(tenant, body("b", network=3 * BLOCK_BYTES)), 403, "quota_exceeded")
    assert error["details"] == {
        "limit": "max_network_bytes",
        "limit_value": 5 * BLOCK_BYTES,
        "in_use": 3 * BLOCK_BYTES,
        "requested": 3 * BLOCK_BYTES,
    }
    assert _post(tenant, body("b", network=2 * BLOCK_BYTES)).status_code == 201  # up to the limit
    assert Node.objects.get().device_reserved_bytes == 8 * BLOCK_BYTES


def test_quota_accepts_network_bytes_with_units(tenant_a, staff_client):
    url = f"/api/v1/admin/tenants/{tenant_a.tenant.pk}/quota"
    response = staff_client.patch(url, {"max_network_bytes": "3 GiB"}, format="json")
    assert response.status_code == 200, response.content
    assert response.json()["max_network_bytes"] == 3 * 2**30
    assert response.json()["overrides"]["max_network_bytes"] == 3 * 2**30
    bad = staff_client.patch(url, {"max_network_bytes": "1.5GiB"}, format="json")
    assert bad.status_code == 400 and "max_network_bytes" in bad.json()["error"]["details"]["fields"]
