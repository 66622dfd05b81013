"""The console's fleet aggregations: tier use over nodes not lost, node counts by state, and the hit rate from the
hit/miss token counters heartbeats carry (optional, non-negative; kept in the node's resident snapshot)."""

from datetime import timedelta

import pytest
from django.utils import timezone

from fleet import selectors, services
from tests.fleet.conftest import GIB, capacity_body

HEARTBEAT = "/api/v1/nodes/heartbeat"
CACHE_A, CACHE_B = "0b7f3c1e-5d2a-4b8e-9f10-1a2b3c4d5e6f", "7a1e2b3c-4d5e-4f60-8a7b-9c0d1e2f3a4b"


def test_heartbeat_keeps_hit_and_miss_counters_when_reported(make_node):
    handle = make_node("n1", device=8 * GIB)
    resident = [
        {"cache_id": CACHE_A, "device_bytes": 1024, "network_bytes": 4096, "hit_tokens": 7, "miss_tokens": 3},
        {"cache_id": CACHE_B, "dram_bytes": 2048},
    ]  # an agent that does not report counters (nor network bytes)
    response = handle.client.post(HEARTBEAT, {"capacity": capacity_body(), "resident": resident}, format="json")
    assert response.status_code == 200, response.json()
    assert handle.refresh().resident_snapshot["caches"] == {
        CACHE_A: {"device": 1024, "dram": 0, "ssd": 0, "network": 4096, "hit_tokens": 7, "miss_tokens": 3},
        CACHE_B: {"device": 0, "dram": 2048, "ssd": 0, "network": 0},
    }
    assert selectors.fleet_network_resident_bytes() == 4096
    assert selectors.fleet_hit_totals() == selectors.HitTotals(hit_tokens=7, miss_tokens=3)
    assert selectors.fleet_hit_totals().rate == 0.7


@pytest.mark.parametrize("bad", [-1, "many", 2**63, 1.5])
def test_heartbeat_refuses_bad_counters_and_keeps_the_snapshot(make_node, bad):
    handle = make_node("n1")
    before = handle.refresh().resident_snapshot
    resident = [{"cache_id": CACHE_A, "hit_tokens": bad}]
    response = handle.client.post(HEARTBEAT, {"capacity": capacity_body(), "resident": resident}, format="json")
    assert response.status_code == 400
    assert handle.refresh().resident_snapshot == before


def test_hit_totals_sum_live_nodes_only_and_rate_is_none_without_reads(make_node):
    assert selectors.fleet_hit_totals().rate is None
    lost = make_node("lost")
    services.node_heartbeat(
        node_id=lost.node.pk,
        capacity=capacity_body(),
        resident=[{"cache_id": CACHE_A, "hit_tokens": 100, "miss_tokens": 100}],
    )
    services.nodes_expire_leases(now=timezone.now() + timedelta(seconds=60))
    live = make_node("live")
    services.node_cordon(node_id=live.node.pk)
    services.node_heartbeat(
        node_id=live.node.pk,
        capacity=capacity_body(),
        resident=[{"cache_id": CACHE_B, "hit_tokens": 0, "miss_tokens": 4}],
    )
    assert selectors.fleet_hit_totals() == selectors.HitTotals(hit_tokens=0, miss_tokens=4)
    assert selectors.fleet_hit_totals().rate == 0.0


def test_tier_use_and_state_counts_leave_lost_nodes_out(make_node):
    lost = make_node("lost", device=GIB)
    services.nodes_expire_leases(now=timezone.now() + timedelta(seconds=60))
    assert lost.refresh().state == "lost"
    ready = make_node("ready", device=8 * GIB, dram=2 * GIB)
    make_node("new", register=False)
    services.node_place(capacity={"device": GIB})
    services.node_heartbeat(
        node_id=ready.node.pk,
        capacity={"device": 8 * GIB, "dram": 2 * GIB, "ssd": 0},
        resident=[{"cache_id": CACHE_A, "device_bytes": 512, "dram_bytes": 256}],
    )
    use = {t.tier: (t.capacity_bytes, t.reserved_bytes, t.resident_bytes) for t in selectors.fleet_tier_use()}
    assert use == {"device": (8 * GIB, GIB, 512), "dram": (2 * GIB, 0, 256), "ssd": (0, 0, 0)}
    assert selectors.node_state_counts() == {"registering": 1, "ready": 1, "draining": 0, "cordoned": 0, "lost": 1}
    node_use = selectors.node_tier_use(ready.refresh())
    assert [(t.tier, t.reserved_bytes, t.resident_bytes) for t in node_use] == [
        ("device", GIB, 512),
        ("dram", 0, 256),
        ("ssd", 0, 0),
    ]
