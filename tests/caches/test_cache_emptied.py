"""A node that comes back without a cache's blocks (an agent restart) leaves the cache `ready` but empty: the API
says so (`emptied_at`, `contents: "cold"` until the node reports blocks of it again) and the tenant's audit trail
records `cache_emptied`, so nobody reads a restart as a service that stopped hitting for no reason."""

import pytest
from rest_framework.test import APIClient

from audit.actions import AuditAction
from audit.models import AuditEvent
from fleet import services as fleet_services
from tests.caches.conftest import attach_body, make_ready

pytestmark = pytest.mark.django_db

CAPACITY = {"device": 2**30, "dram": 2**30, "ssd": 2**30}


def _register(agent, caches):
    body = {"endpoint": "10.3.0.9:7000", "capacity": CAPACITY, "caches": caches}
    answer = agent.post("/api/v1/nodes/register", body, format="json")
    assert answer.status_code == 200, answer.content
    return answer.json()


def _heartbeat(agent, cache_id, device_bytes):
    resident = [{"cache_id": cache_id, "device_bytes": device_bytes, "dram_bytes": 0, "ssd_bytes": 0}]
    answer = agent.post("/api/v1/nodes/heartbeat", {"capacity": CAPACITY, "resident": resident}, format="json")
    assert answer.status_code == 200, answer.content


def test_a_restart_without_the_blocks_marks_the_cache_emptied_and_cold(tenant_a, tenant_b):
    issued = fleet_services.node_create(name="restarting-node")
    agent = APIClient()
    agent.credentials(HTTP_AUTHORIZATION=f"Bearer {issued.credential}")
    _register(agent, [])
    cache_id = tenant_a.client.post("/api/v1/caches", attach_body(), format="json").json()["id"]
    make_ready(cache_id)

    def shown() -> dict:
        return tenant_a.client.get(f"/api/v1/caches/{cache_id}").json()

    assert (shown()["contents"], shown()["emptied_at"]) == ("cold", None)  # new: nothing stored yet
    _heartbeat(agent, cache_id, 4096)
    assert shown()["contents"] == "warm"

    _register(agent, [])  # the agent restarted holding nothing
    make_ready(cache_id)  # provisioned again, empty
    after = shown()
    assert after["state"] == "ready" and after["contents"] == "cold" and after["emptied_at"] is not None
    assert [c["contents"] for c in tenant_a.client.get("/api/v1/caches").json()["results"]] == ["cold"]
    (event,) = AuditEvent.objects.filter(action=AuditAction.CACHE_EMPTIED)
    assert str(event.target_id) == cache_id and event.tenant_id == tenant_a.tenant.pk
    assert tenant_b.client.get(f"/api/v1/caches/{cache_id}").status_code == 404  # still the owner's alone

    _heartbeat(agent, cache_id, 8192)  # the engine refilled it
    assert shown()["contents"] == "warm" and shown()["emptied_at"] == after["emptied_at"]


def test_a_re_register_that_kept_the_blocks_empties_nothing(tenant_a):
    issued = fleet_services.node_create(name="steady-node")
    agent = APIClient()
    agent.credentials(HTTP_AUTHORIZATION=f"Bearer {issued.credential}")
    _register(agent, [])
    cache_id = tenant_a.client.post("/api/v1/caches", attach_body(), format="json").json()["id"]
    make_ready(cache_id)
    _register(agent, [cache_id])
    assert tenant_a.client.get(f"/api/v1/caches/{cache_id}").json()["emptied_at"] is None
    assert not AuditEvent.objects.filter(action=AuditAction.CACHE_EMPTIED).exists()


def test_a_list_reads_each_nodes_snapshot_once_whatever_the_page_size(tenant_a, django_assert_max_num_queries):
    """contents on a list page costs one query for all its caches' nodes, not one (with the node's whole resident
    snapshot) per cache."""
    issued = fleet_services.node_create(name="listed-node")
    agent = APIClient()
    agent.credentials(HTTP_AUTHORIZATION=f"Bearer {issued.credential}")
    _register(agent, [])
    ids = [tenant_a.client.post("/api/v1/caches", attach_body(f"c{i}"), format="json").json()["id"] for i in range(6)]
    for cache_id in ids:
        make_ready(cache_id)
    _heartbeat(agent, ids[0], 4096)

    def listed(limit: int) -> list[str]:
        answer = tenant_a.client.get(f"/api/v1/caches?limit={limit}")
        assert answer.status_code == 200, answer.content
        return [cache["contents"] for cache in answer.json()["results"]]

    listed(2)  # warms the per-process caches (rate limits, key lookups) so both counts below are like for like
    with django_assert_max_num_queries(50) as two:
        assert len(listed(2)) == 2
    with django_assert_max_num_queries(50) as six:
        assert sorted(listed(6)) == ["cold"] * 5 + ["warm"]
    assert len(six.captured_queries) == len(two.captured_queries)


def test_contents_and_node_fields_mean_what_they_say_from_attach_to_detach(tenant_a):
    """contents is only a ready cache's (null while provisioning and once detached, when no node serves it); a
    detached cache names no node; a fresh cache is cold without emptied_at (never said to be emptied)."""
    from caches import services

    issued = fleet_services.node_create(name="lifecycle-node")
    agent = APIClient()
    agent.credentials(HTTP_AUTHORIZATION=f"Bearer {issued.credential}")
    _register(agent, [])
    cache_id = tenant_a.client.post("/api/v1/caches", attach_body(), format="json").json()["id"]

    def shown() -> dict:
        return tenant_a.client.get(f"/api/v1/caches/{cache_id}").json()

    assert shown()["state"] in ("pending", "provisioning") and shown()["contents"] is None
    make_ready(cache_id)
    assert (shown()["contents"], shown()["emptied_at"]) == ("cold", None) and shown()["node_id"] is not None
    _heartbeat(agent, cache_id, 4096)
    assert shown()["contents"] == "warm"

    assert tenant_a.client.delete(f"/api/v1/caches/{cache_id}").status_code in (200, 202)
    assert shown()["state"] == "detaching" and shown()["contents"] is None
    services.cache_detach_result(cache_id=cache_id, node_id=issued.node.pk)
    gone = shown()
    assert gone["state"] == "detached" and gone["contents"] is None
    assert (gone["node_id"], gone["endpoint"]) == (None, "")
    listed = tenant_a.client.get("/api/v1/caches", {"state": "detached"}).json()["results"]
    assert [(c["node_id"], c["endpoint"], c["contents"]) for c in listed] == [(None, "", None)]
