"""A (re-)registering node is told which caches the control plane believes it hosts (fleet's register response,
filled by caches.selectors.caches_on_node through settings.KCAAS_NODE_CACHES_SELECTOR)."""

from rest_framework.test import APIClient

from fleet import services as fleet_services
from tests.caches.conftest import attach_body, make_ready

CAPACITY = {"device": 2**30, "dram": 2**30, "ssd": 2**30}


def test_register_lists_the_nodes_live_caches(tenant_a):
    issued = fleet_services.node_create(name="restarting-node")
    agent = APIClient()
    agent.credentials(HTTP_AUTHORIZATION=f"Bearer {issued.credential}")
    first = agent.post("/api/v1/nodes/register", {"endpoint": "10.3.0.1:7000", "capacity": CAPACITY}, format="json")
    assert first.status_code == 200 and first.json()["caches"] == []

    cache_id = tenant_a.client.post("/api/v1/caches", attach_body(), format="json").json()["id"]
    make_ready(cache_id)
    again = agent.post("/api/v1/nodes/register", {"endpoint": "10.3.0.1:7000", "capacity": CAPACITY}, format="json")
    assert again.status_code == 200
    (listed,) = again.json()["caches"]
    assert listed["cache_id"] == cache_id and listed["epoch"] == 1 and listed["state"] == "ready"
    assert listed["capacity"]["device"] == attach_body()["capacity"]["device"]
