"""Bad input to node endpoints is a 400 with field details, never a 500 and never a state change."""

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from fleet.validators import endpoint_error, endpoint_normalize

from .conftest import GIB, capacity_body

REGISTER = "/api/v1/nodes/register"
HEARTBEAT = "/api/v1/nodes/heartbeat"


@pytest.mark.parametrize(
    "endpoint",
    ["node-a:7000", "10.0.0.5:1", "[::1]:65535", "a.b.c.example.com:443", "localhost:7000", "[2001:db8::1]:7000"],
)
def test_valid_endpoints(endpoint):
    assert endpoint_error(endpoint) is None


@pytest.mark.parametrize(
    "endpoint",
    [
        "",
        "node-a",
        "node-a:",
        "node-a:0",
        "node-a:65536",
        "node-a:+80",
        "node-a:http",
        "::1:7000",
        "[::1]7000",
        "http://node-a:7000",
        "node-a:7000/x",
        "-bad:7000",
        "bad-:7000",
        "a..b:7000",
        "0.0.0.0:7000",
        "[::]:7000",
        "256.1.1.1:7000",
        "1.2.3:7000",
        "[fe80::1%eth0]:7000",
        "224.0.0.1:7000",
        "a_b:7000",
        "x" * 64 + ":7000",
        "é.example:7000",
        " node-a:7000",
        "node-a:7000 ",
        ("a." * 130) + "b:7000",
    ],
)
def test_invalid_endpoints_are_400_with_details(make_node, endpoint):
    assert endpoint_error(endpoint) is not None
    handle = make_node("n1", register=False)
    response = handle.client.post(REGISTER, {"endpoint": endpoint, "capacity": capacity_body()}, format="json")
    assert response.status_code == 400, response.json()
    error = response.json()["error"]
    assert error["code"] == "validation_error" and "endpoint" in error["details"]["fields"]
    assert handle.refresh().state == "registering"


@given(st.text(max_size=300))
@hsettings(max_examples=300, deadline=None)
def test_endpoint_validation_never_crashes(text):
    if endpoint_error(text) is None:
        normalized = endpoint_normalize(text)
        assert endpoint_error(normalized) is None and endpoint_normalize(normalized) == normalized


@pytest.mark.parametrize(
    "capacity, bad_field",
    [
        ({"device": -1, "dram": 0, "ssd": 0}, "device"),
        ({"device": 2**50 + 1, "dram": 0, "ssd": 0}, "device"),
        ({"device": 2**70, "dram": 0, "ssd": 0}, "device"),
        ({"device": 1.5, "dram": 0, "ssd": 0}, "device"),
        ({"device": True, "dram": 0, "ssd": 0}, "device"),
        ({"device": "lots", "dram": 0, "ssd": 0}, "device"),
        ({"device": None, "dram": 0, "ssd": 0}, "device"),
        ({"dram": 0, "ssd": 0}, "device"),
        ({"device": 0, "dram": 0}, "ssd"),
    ],
)
def test_bad_capacities_are_400_with_tier_details(make_node, capacity, bad_field):
    handle = make_node("n1", device=GIB)
    for url, body in ((REGISTER, {"endpoint": "n1:7000", "capacity": capacity}), (HEARTBEAT, {"capacity": capacity})):
        response = handle.client.post(url, body, format="json")
        assert response.status_code == 400, (url, response.json())
        fields = response.json()["error"]["details"]["fields"]
        assert bad_field in fields["capacity"], fields
    assert handle.refresh().device_capacity_bytes == GIB


@pytest.mark.parametrize(
    "body",
    [
        [],
        "capacity",
        {"capacity": [1, 2, 3]},
        {"capacity": capacity_body(), "resident": {"cache_id": "x"}},
        {"capacity": capacity_body(), "resident": [{"cache_id": "not-a-uuid"}]},
        {
            "capacity": capacity_body(),
            "resident": [{"cache_id": "0b7f3c1e-5d2a-4b8e-9f10-1a2b3c4d5e6f", "device_bytes": -5}],
        },
        {"capacity": capacity_body(), "resident": [{"cache_id": "0b7f3c1e-5d2a-4b8e-9f10-1a2b3c4d5e6f"}] * 2},
    ],
)
def test_bad_heartbeats_are_400(make_node, body):
    handle = make_node("n1", device=GIB)
    lease = handle.node.lease_expires_at
    response = handle.client.post(HEARTBEAT, body, format="json")
    assert response.status_code == 400, response.json()
    assert response.json()["error"]["code"] == "validation_error"
    assert handle.refresh().lease_expires_at == lease


def test_malformed_json_is_400(make_node):
    handle = make_node("n1", device=GIB)
    response = handle.client.post(HEARTBEAT, data="{not json", content_type="application/json")
    assert response.status_code == 400 and response.json()["error"]["code"] == "malformed_request"
