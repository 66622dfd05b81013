"""Best-fit placement, reservations and their release."""

from datetime import timedelta

import pytest
from django.utils import timezone

from core.errors import exception_handler
from fleet import services
from fleet.errors import InvalidCapacity, NoCapacity
from fleet.models import Node

from .conftest import GIB


def test_best_fit_picks_the_node_left_with_the_least_free_bytes(make_node):
    make_node("roomy", device=40 * GIB)
    tight = make_node("tight", device=10 * GIB)
    make_node("medium", device=20 * GIB)
    make_node("too-small", device=5 * GIB)

    node = services.node_place(capacity={"device": 8 * GIB})
    assert node.pk == tight.node.pk
    assert node.device_reserved_bytes == 8 * GIB
    # tight has 2 GiB left now; the next 8 GiB cache goes to medium (12 left) rather than roomy (32 left).
    assert services.node_place(capacity={"device": 8 * GIB}).name == "medium"
    # 2 GiB fits tight exactly: zero left is the best fit of all.
    assert services.node_place(capacity={"device": 2 * GIB}).name == "tight"
    assert Node.objects.get(name="tight").free["device"] == 0


def test_best_fit_counts_existing_reservations(make_node):
    big = make_node("big", device=100 * GIB)
    make_node("small", device=30 * GIB)
    Node.objects.filter(pk=big.node.pk).update(device_reserved_bytes=95 * GIB)  # 5 GiB free
    assert services.node_place(capacity={"device": 4 * GIB}).name == "big"
    assert services.node_place(capacity={"device": 4 * GIB}).name == "small"  # big has 1 GiB left


def test_every_requested_tier_must_fit_and_the_fastest_one_ranks(make_node):
    make_node("no-ssd", device=10 * GIB, dram=100 * GIB, ssd=0)
    make_node("ssd-rich", device=16 * GIB, dram=100 * GIB, ssd=500 * GIB)
    make_node("ssd-tight", device=12 * GIB, dram=100 * GIB, ssd=100 * GIB)
    request = {"device": 8 * GIB, "dram": 16 * GIB, "ssd": 50 * GIB}
    node = services.node_place(capacity=request)
    assert node.name == "ssd-tight"  # no-ssd would fit device best, but not ssd
    assert node.reserved == request
    # dram-only requests rank on dram: ties on dram (100 GiB each) fall through to the name.
    assert services.node_place(capacity={"dram": 84 * GIB}).name == "ssd-tight"  # 100 - 16 - 84 = 0 left
    assert services.node_place(capacity={"dram": 10 * GIB}).name == "no-ssd"  # 90 left vs ssd-rich's 90: name


def test_ties_on_the_primary_tier_fall_to_the_next_tier_then_the_name(make_node):
    make_node("b-node", device=10 * GIB, dram=50 * GIB)
    make_node("a-node", device=10 * GIB, dram=80 * GIB)
    make_node("c-node", device=10 * GIB, dram=20 * GIB)
    # device leaves 9 GiB on all three: the tie goes to the least dram left (c-node, 19 GiB).
    assert services.node_place(capacity={"device": GIB, "dram": GIB}).name == "c-node"
    # c-node now has 9 GiB device free, the others 10: the primary tier decides before anything else.
    assert services.node_place(capacity={"device": GIB}).name == "c-node"
    # 9 GiB fits a-node and b-node only, leaving 1 GiB on each; dram is not requested, so the name decides.
    assert services.node_place(capacity={"device": 9 * GIB}).name == "a-node"


@pytest.mark.parametrize("state", ["registering", "draining", "cordoned", "lost"])
def test_only_ready_nodes_are_placed_on(make_node, state):
    make_node("other", device=8 * GIB, state=state)
    ready = make_node("ready", device=100 * GIB)
    assert services.node_place(capacity={"device": 8 * GIB}).pk == ready.node.pk


def test_cordon_drain_and_uncordon_change_placement(make_node):
    tight = make_node("tight", device=10 * GIB)
    make_node("roomy", device=50 * GIB)
    services.node_cordon(node_id=tight.node.pk)
    assert services.node_place(capacity={"device": GIB}).name == "roomy"
    services.node_uncordon(node_id=tight.node.pk)
    assert services.node_place(capacity={"device": GIB}).name == "tight"
    services.node_drain(node_id=tight.node.pk)
    assert services.node_place(capacity={"device": GIB}).name == "roomy"


def test_nodes_with_an_expired_lease_are_skipped_before_the_sweep(make_node):
    t0 = timezone.now()
    make_node("stale", device=10 * GIB, now=t0 - timedelta(seconds=60))
    fresh = make_node("fresh", device=50 * GIB, now=t0)
    assert services.node_place(capacity={"device": GIB}, now=t0).pk == fresh.node.pk


def test_no_capacity_raises_and_reserves_nothing(make_node):
    make_node("a", device=10 * GIB, dram=10 * GIB)
    make_node("b", device=4 * GIB, dram=100 * GIB)
    with pytest.raises(NoCapacity) as raised:
        services.node_place(capacity={"device": 8 * GIB, "dram": 20 * GIB})
    assert raised.value.status_code == 503 and raised.value.code == "no_capacity"
    response = exception_handler(raised.value, {})
    assert response.status_code == 503
    assert response.data["error"]["code"] == "no_capacity"
    details = response.data["error"]["details"]
    assert details["requested"] == {"device": 8 * GIB, "dram": 20 * GIB, "ssd": 0}
    # The largest free bytes per tier on any ready node (a: 10 GiB device, b: 100 GiB DRAM), never a node's name.
    assert details["largest_free"] == {"device": 10 * GIB, "dram": 100 * GIB, "ssd": 0}
    assert "KCAAS_NODE_DEVICE_BYTES" in details["hint"]
    assert "KCAAS_NODE_DEVICE_BYTES" in response.data["error"]["message"]
    assert "a" not in details and "b" not in details and "nodes" not in details
    assert {n.name: n.reserved for n in Node.objects.all()} == {
        "a": {"device": 0, "dram": 0, "ssd": 0},
        "b": {"device": 0, "dram": 0, "ssd": 0},
    }


def test_no_nodes_at_all_is_no_capacity(db):
    with pytest.raises(NoCapacity) as raised:
        services.node_place(capacity={"ssd": 1})
    assert raised.value.details["largest_free"] == {"device": 0, "dram": 0, "ssd": 0}
    assert "KCAAS_NODE_SSD_BYTES" in raised.value.details["hint"]


def test_no_capacity_counts_only_ready_nodes_and_their_reservations(make_node):
    make_node("ready", device=10 * GIB)
    cordoned = make_node("cordoned", device=100 * GIB)
    services.node_cordon(node_id=cordoned.node.pk)
    services.node_place(capacity={"device": 4 * GIB})
    with pytest.raises(NoCapacity) as raised:
        services.node_place(capacity={"device": 7 * GIB})
    assert raised.value.details["largest_free"] == {"device": 6 * GIB, "dram": 0, "ssd": 0}


@pytest.mark.parametrize(
    "capacity",
    [{}, {"device": 0}, {"hbm": 1}, {"device": -1}, {"device": 1.5}, {"device": True}, {"device": "1"}, [1]],
)
def test_bad_placement_requests_are_refused(make_node, capacity):
    make_node("a", device=10 * GIB)
    with pytest.raises(InvalidCapacity) as raised:
        services.node_place(capacity=capacity)
    assert raised.value.status_code == 400 and raised.value.code == "invalid_capacity"


def test_unreserve_gives_bytes_back_and_never_goes_negative(make_node):
    handle = make_node("a", device=10 * GIB, dram=10 * GIB)
    services.node_place(capacity={"device": 6 * GIB, "dram": GIB})
    node = services.node_unreserve(node_id=handle.node.pk, capacity={"device": 6 * GIB, "dram": GIB})
    assert node.reserved == {"device": 0, "dram": 0, "ssd": 0}
    assert services.node_place(capacity={"device": 10 * GIB}).pk == handle.node.pk
    node = services.node_unreserve(node_id=handle.node.pk, capacity={"device": 11 * GIB})
    assert node.device_reserved_bytes == 0


def test_capacity_reported_below_reservations_leaves_no_room(make_node):
    handle = make_node("a", device=10 * GIB)
    services.node_place(capacity={"device": 8 * GIB})
    services.node_heartbeat(node_id=handle.node.pk, capacity={"device": 4 * GIB, "dram": 0, "ssd": 0})
    node = handle.refresh()
    assert node.device_reserved_bytes == 8 * GIB and node.free["device"] == 0
    with pytest.raises(NoCapacity):
        services.node_place(capacity={"device": 1})
