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


def test_the_register_answer_names_the_caches_whose_blocks_the_node_may_store(tenant_a, make_node):
    from caches import services
    from caches.migration import migration_start

    issued = fleet_services.node_create(name="storing-node")
    agent = APIClient()
    agent.credentials(HTTP_AUTHORIZATION=f"Bearer {issued.credential}")
    assert register(agent, []).json()["stored_caches"] == []

    def attach(name: str) -> str:
        return tenant_a.client.post("/api/v1/caches", attach_body(name), format="json").json()["id"]

    placed, failed = attach("placed"), attach("failed")
    make_ready(placed)
    services.cache_provision_result(cache_id=failed, node_id=issued.node.pk, ok=False, reason="allocation_failed")
    fleet_services.node_cordon(node_id=issued.node.pk)
    other = make_node()
    moving = attach("moving")  # placed on the other node (this one is cordoned), then moved here
    assert str(Cache.objects.get(pk=moving).node_id) == str(other.pk)
    make_ready(moving)
    fleet_services.node_uncordon(node_id=issued.node.pk)
    migration_start(cache_id=moving, target_node_id=issued.node.pk)

    stored = register(agent, [placed]).json()["stored_caches"]
    assert stored == sorted([placed, moving])  # not the failed one: its blocks are nobody's to keep
