"""Register, heartbeat, lease expiry and re-registration of node agents."""

from datetime import timedelta

import pytest
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from fleet import services
from fleet.errors import EndpointInUse, ReregisterRequired
from fleet.models import Node

from .conftest import GIB, capacity_body

REGISTER = "/api/v1/nodes/register"
HEARTBEAT = "/api/v1/nodes/heartbeat"
LEASE = timedelta(seconds=40)


@pytest.fixture(autouse=True)
def _lease_settings(settings):
    settings.KCAAS_NODE_LEASE_SECONDS = 40
    settings.KCAAS_NODE_HEARTBEAT_SECONDS = 10


def _register(handle, endpoint="node-a.internal:7000", **capacity):
    return handle.client.post(REGISTER, {"endpoint": endpoint, "capacity": capacity_body(**capacity)}, format="json")


def test_register_makes_the_node_ready_with_a_lease(make_node):
    handle = make_node("n1", register=False)
    before = timezone.now()
    response = _register(handle, endpoint="Node-A.Internal:07000", device=8 * GIB)
    assert response.status_code == 200, response.json()
    body = response.json()
    assert body["node"]["id"] == str(handle.node.pk)
    assert body["node"]["state"] == "ready"
    assert body["node"]["endpoint"] == "node-a.internal:7000"  # normalized
    assert body["node"]["capacity"] == capacity_body(device=8 * GIB)
    assert body["node"]["reserved"] == {"device": 0, "dram": 0, "ssd": 0}
    assert body["heartbeat_interval_seconds"] == 10 and body["lease_seconds"] == 40
    assert body["caches"] == []
    lease = parse_datetime(body["node"]["lease_expires_at"])
    assert before + LEASE <= lease <= timezone.now() + LEASE
    node = handle.refresh()
    assert node.state == "ready" and node.lease_expires_at == lease


def test_heartbeat_renews_the_lease_and_records_capacity_and_resident_bytes(make_node):
    handle = make_node("n1")
    first_lease = handle.node.lease_expires_at
    cache_a, cache_b = "0b7f3c1e-5d2a-4b8e-9f10-1a2b3c4d5e6f", "7a1e2b3c-4d5e-4f60-8a7b-9c0d1e2f3a4b"
    resident = [
        {"cache_id": cache_a, "device_bytes": 1024, "dram_bytes": 2048, "ssd_bytes": 0},
        {"cache_id": cache_b, "ssd_bytes": 4096},
    ]
    response = handle.client.post(
        HEARTBEAT, {"capacity": capacity_body(device=4 * GIB), "resident": resident}, format="json"
    )
    assert response.status_code == 200, response.json()
    body = response.json()
    assert body["state"] == "ready" and body["heartbeat_interval_seconds"] == 10
    node = handle.refresh()
    assert node.lease_expires_at == parse_datetime(body["lease_expires_at"]) >= first_lease
    assert node.device_capacity_bytes == 4 * GIB
    assert node.resident_snapshot["caches"] == {
        cache_a: {"device": 1024, "dram": 2048, "ssd": 0, "network": 0},
        cache_b: {"device": 0, "dram": 0, "ssd": 4096, "network": 0},
    }
    # A heartbeat without `resident` keeps the last snapshot; an empty list replaces it.
    handle.client.post(HEARTBEAT, {"capacity": capacity_body()}, format="json")
    assert set(handle.refresh().resident_snapshot["caches"]) == {cache_a, cache_b}
    handle.client.post(HEARTBEAT, {"capacity": capacity_body(), "resident": []}, format="json")
    assert handle.refresh().resident_snapshot["caches"] == {}


def test_heartbeat_service_drives_the_lease_from_now(make_node):
    t0 = timezone.now()
    handle = make_node("n1", now=t0)
    node = services.node_heartbeat(node_id=handle.node.pk, capacity=capacity_body(), now=t0 + timedelta(seconds=25))
    assert node.lease_expires_at == t0 + timedelta(seconds=25) + LEASE
    assert node.last_heartbeat_at == t0 + timedelta(seconds=25)


def test_heartbeat_before_registration_is_refused(make_node):
    handle = make_node("n1", register=False)
    response = handle.client.post(HEARTBEAT, {"capacity": capacity_body()}, format="json")
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "reregister_required"


def test_expired_leases_make_nodes_lost_and_only_register_brings_them_back(make_node):
    t0 = timezone.now()
    live = make_node("live", now=t0)
    dying = make_node("dying", now=t0 - timedelta(seconds=30))
    cordoned = make_node("cordoned", now=t0 - timedelta(seconds=30))
    services.node_cordon(node_id=cordoned.node.pk)
    unregistered = make_node("new", register=False)

    assert services.nodes_expire_leases(now=t0 + timedelta(seconds=5)) == []
    expired = services.nodes_expire_leases(now=t0 + timedelta(seconds=11))
    assert sorted(expired) == sorted([dying.node.pk, cordoned.node.pk])
    assert dying.refresh().state == cordoned.refresh().state == "lost"
    assert live.refresh().state == "ready" and unregistered.refresh().state == "registering"
    assert services.nodes_expire_leases(now=t0 + timedelta(seconds=11)) == []  # idempotent

    response = dying.client.post(HEARTBEAT, {"capacity": capacity_body()}, format="json")
    assert response.status_code == 409 and response.json()["error"]["code"] == "reregister_required"
    assert dying.refresh().state == "lost"

    response = _register(dying, endpoint="dying.internal:7000")
    assert response.status_code == 200
    assert response.json()["node"]["id"] == str(dying.node.pk) and response.json()["node"]["state"] == "ready"
    assert dying.client.post(HEARTBEAT, {"capacity": capacity_body()}, format="json").status_code == 200


def test_heartbeat_in_time_keeps_the_node(make_node):
    t0 = timezone.now()
    handle = make_node("n1", now=t0)
    services.node_heartbeat(node_id=handle.node.pk, capacity=capacity_body(), now=t0 + timedelta(seconds=30))
    assert services.nodes_expire_leases(now=t0 + timedelta(seconds=60)) == []
    assert services.nodes_expire_leases(now=t0 + timedelta(seconds=71)) == [handle.node.pk]


def test_reregister_keeps_identity_reservations_and_operator_state(make_node):
    handle = make_node("n1", device=8 * GIB)
    services.node_place(capacity={"device": GIB})
    services.node_cordon(node_id=handle.node.pk)
    response = _register(handle, endpoint="10.1.2.3:7100", device=8 * GIB)
    assert response.status_code == 200
    body = response.json()["node"]
    assert body["id"] == str(handle.node.pk)
    assert body["state"] == "cordoned"  # an agent restart does not undo a cordon
    assert body["endpoint"] == "10.1.2.3:7100"
    assert body["reserved"]["device"] == GIB
    assert Node.objects.count() == 1


def test_two_live_nodes_cannot_share_an_endpoint(make_node):
    a, b = make_node("a", register=False), make_node("b", register=False)
    assert _register(a, endpoint="[2001:db8::1]:7000").status_code == 200
    response = _register(b, endpoint="[2001:0db8:0::1]:7000")  # the same address, spelled differently
    assert response.status_code == 409 and response.json()["error"]["code"] == "endpoint_in_use"
    assert b.refresh().state == "registering"
    with pytest.raises(EndpointInUse):
        services.node_register(node_id=b.node.pk, endpoint="[2001:db8::1]:7000", capacity=capacity_body())
    # Once `a` is lost, its endpoint may be taken over (a replacement machine on the same address).
    services.nodes_expire_leases(now=timezone.now() + timedelta(seconds=41))
    assert _register(b, endpoint="[2001:db8::1]:7000").status_code == 200


def test_lost_node_heartbeat_service_raises(make_node):
    handle = make_node("n1", state="lost")
    with pytest.raises(ReregisterRequired):
        services.node_heartbeat(node_id=handle.node.pk, capacity=capacity_body())
