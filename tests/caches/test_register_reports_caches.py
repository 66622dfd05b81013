"""A (re-)registering node reports the caches it still holds; the control plane provisions again those it lost
(an agent restart empties its pools) and answers with what the node should host (fleet's register response,
reconciled by caches.services.caches_reconcile_node through settings.KCAAS_NODE_REGISTER_RECONCILER)."""

from rest_framework.test import APIClient

from caches.models import Cache
from fleet import services as fleet_services
from tests.caches.conftest import attach_body, make_ready

CAPACITY = {"device": 2**30, "dram": 2**30, "ssd": 2**30}


def register(agent, caches):
    body = {"endpoint": "10.3.0.1:7000", "capacity": CAPACITY, "caches": caches}
    return agent.post("/api/v1/nodes/register", body, format="json")


def test_a_restarted_node_gets_its_lost_caches_provisioned_again(tenant_a, django_capture_on_commit_callbacks):
    issued = fleet_services.node_create(name="restarting-node")
    agent = APIClient()
    agent.credentials(HTTP_AUTHORIZATION=f"Bearer {issued.credential}")
    first = register(agent, [])
    assert first.status_code == 200 and first.json()["caches"] == []

    cache_id = tenant_a.client.post("/api/v1/caches", attach_body(), format="json").json()["id"]
    make_ready(cache_id)

    still_held = register(agent, [cache_id])  # a re-register that kept its pools: nothing to do
    assert [c["state"] for c in still_held.json()["caches"]] == ["ready"]

    with django_capture_on_commit_callbacks() as sent:
        restarted = register(agent, [])  # the agent restarted: it holds nothing
    (listed,) = restarted.json()["caches"]
    assert listed["cache_id"] == cache_id and listed["epoch"] == 1 and listed["state"] == "provisioning"
    assert len(sent) == 1  # one provision_cache to the node's queue, on commit
    assert Cache.objects.get(pk=cache_id).state == "provisioning"
    make_ready(cache_id)
    assert Cache.objects.get(pk=cache_id).state == "ready"
