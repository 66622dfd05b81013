"""Staff endpoints: create (credential shown once), list, detail, cordon/uncordon; nobody else gets in."""

import uuid

import pytest
from rest_framework.test import APIClient

from fleet.models import Node

from .conftest import GIB, bearer_client

NODES = "/api/v1/admin/nodes"


def _node_url(node_id, action=""):
    return f"{NODES}/{node_id}" + (f"/{action}" if action else "")


def test_staff_create_a_node_and_see_its_credential_once(staff_client):
    response = staff_client.post(NODES, {"name": "gpu-01"}, format="json")
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["credential"].startswith("kc_node_")
    assert body["node"]["name"] == "gpu-01" and body["node"]["state"] == "registering"
    assert body["node"]["endpoint"] == "" and body["node"]["lease_expires_at"] is None
    detail = staff_client.get(_node_url(body["node"]["id"])).json()
    assert "credential" not in detail and body["credential"] not in str(detail)
    # The credential works on node endpoints.
    register = {"endpoint": "gpu-01:7000", "capacity": {"device": GIB, "dram": GIB, "ssd": 0}}
    assert bearer_client(body["credential"]).post("/api/v1/nodes/register", register, format="json").status_code == 200


def test_duplicate_node_name_is_409(staff_client):
    assert staff_client.post(NODES, {"name": "gpu-01"}, format="json").status_code == 201
    response = staff_client.post(NODES, {"name": "gpu-01"}, format="json")
    assert response.status_code == 409 and response.json()["error"]["code"] == "node_name_taken"
    assert Node.objects.count() == 1


@pytest.mark.parametrize(
    "body, field",
    [
        ({}, "name"),
        ({"name": ""}, "name"),
        ({"name": "-x"}, "name"),
        ({"name": "a b"}, "name"),
        ({"name": "x" * 101}, "name"),
        ({"name": ["a"]}, "name"),
    ],
)
def test_bad_node_names_are_400_with_field_details(staff_client, body, field):
    response = staff_client.post(NODES, body, format="json")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "validation_error" and field in error["details"]["fields"]


def test_list_filters_and_paginates(staff_client, make_node):
    make_node("b-node", device=GIB)
    make_node("a-node", device=GIB)
    make_node("c-node", register=False)
    body = staff_client.get(NODES).json()
    assert body["count"] == 3 and [n["name"] for n in body["results"]] == ["a-node", "b-node", "c-node"]
    ready = staff_client.get(NODES, {"state": "ready"}).json()
    assert [n["name"] for n in ready["results"]] == ["a-node", "b-node"]
    page = staff_client.get(NODES, {"limit": 1, "offset": 1}).json()
    assert page["count"] == 3 and [n["name"] for n in page["results"]] == ["b-node"] and page["next"]
    response = staff_client.get(NODES, {"state": "sleeping"})
    assert response.status_code == 400 and "state" in response.json()["error"]["details"]["fields"]


def test_detail_shows_capacity_reservations_and_resident_snapshot(staff_client, make_node):
    from fleet import services

    handle = make_node("n1", device=8 * GIB, dram=32 * GIB)
    services.node_place(capacity={"device": 3 * GIB})
    cache_id = str(uuid.uuid4())
    services.node_heartbeat(
        node_id=handle.node.pk,
        capacity={"device": 8 * GIB, "dram": 32 * GIB, "ssd": 0},
        resident=[{"cache_id": cache_id, "device_bytes": 5}],
    )
    body = staff_client.get(_node_url(handle.node.pk)).json()
    assert body["capacity"] == {"device": 8 * GIB, "dram": 32 * GIB, "ssd": 0}
    assert body["reserved"] == {"device": 3 * GIB, "dram": 0, "ssd": 0}
    assert body["free"] == {"device": 5 * GIB, "dram": 32 * GIB, "ssd": 0}
    assert body["resident"]["caches"] == {cache_id: {"device": 5, "dram": 0, "ssd": 0, "network": 0}}


def test_unknown_node_is_404(staff_client):
    missing = uuid.uuid4()
    for method, url in (
        ("get", _node_url(missing)),
        ("post", _node_url(missing, "cordon")),
        ("post", _node_url(missing, "uncordon")),
        ("get", f"{NODES}/not-a-uuid"),
    ):
        response = getattr(staff_client, method)(url)
        assert response.status_code == 404, url
        assert response.json()["error"]["code"] == "not_found"


def test_cordon_and_uncordon_are_idempotent_state_changes(staff_client, make_node):
    handle = make_node("n1", device=GIB)
    for _ in range(2):
        response = staff_client.post(_node_url(handle.node.pk, "cordon"))
        assert response.status_code == 200 and response.json()["state"] == "cordoned"
    for _ in range(2):
        response = staff_client.post(_node_url(handle.node.pk, "uncordon"))
        assert response.status_code == 200 and response.json()["state"] == "ready"


def test_a_draining_node_can_be_returned_to_service(staff_client, make_node):
    handle = make_node("n1", device=GIB, state="draining")  # a drain that finished, or one stuck on failed moves
    response = staff_client.post(_node_url(handle.node.pk, "uncordon"))
    assert response.status_code == 200 and response.json()["state"] == "ready"
    assert handle.refresh().state == "ready"


@pytest.mark.parametrize(
    "state, action",
    [
        ("lost", "cordon"),
        ("registering", "cordon"),
        ("draining", "cordon"),
        ("lost", "uncordon"),
        ("registering", "uncordon"),
    ],
)
def test_cordon_from_the_wrong_state_is_409(staff_client, make_node, state, action):
    handle = make_node("n1", device=GIB, state=state)
    response = staff_client.post(_node_url(handle.node.pk, action))
    assert response.status_code == 409
    error = response.json()["error"]
    assert error["code"] == "invalid_node_state" and error["details"]["state"] == state
    assert handle.refresh().state == state


def _admin_calls(node_id):
    return [
        ("get", NODES, None),
        ("post", NODES, {"name": "x"}),
        ("get", _node_url(node_id), None),
        ("post", _node_url(node_id, "cordon"), None),
        ("post", _node_url(node_id, "uncordon"), None),
    ]


def test_admin_endpoints_refuse_non_staff_users(user_client, make_node):
    handle = make_node("n1", device=GIB)
    for method, url, body in _admin_calls(handle.node.pk):
        response = getattr(user_client, method)(url, body, format="json")
        assert response.status_code == 403, url
        assert response.json()["error"]["code"] == "permission_denied"
    assert handle.refresh().state == "ready" and Node.objects.count() == 1


def test_admin_endpoints_refuse_tenant_keys(tenant_key, make_node):
    handle = make_node("n1", device=GIB)
    for method, url, body in _admin_calls(handle.node.pk):
        response = getattr(bearer_client(tenant_key), method)(url, body, format="json")
        assert response.status_code == 403, url
    assert handle.refresh().state == "ready" and Node.objects.count() == 1


def test_admin_endpoints_refuse_anonymous_and_nodes(make_node):
    handle = make_node("n1", device=GIB)
    for client in (APIClient(), handle.client):
        for method, url, body in _admin_calls(handle.node.pk):
            response = getattr(client, method)(url, body, format="json")
            assert response.status_code == 401, url
