"""bench.controlplane's set-up runs again at once: the same node, registered again, is the only one placement can
choose, and the caches an earlier run left on it are released (an older run's still-leased node once got the new
caches placed on it, never answered, and every token issue was a 409 cache_not_ready)."""

import pytest

from bench.controlplane import BENCH_NODE, percentile, release_caches, set_up
from caches import services as cache_services
from caches.models import Cache
from fleet import services as fleet_services
from fleet.models import Node, NodeState
from kcaas.spec import KVCacheSpec

pytestmark = pytest.mark.django_db

GIB = 2**30


def test_set_up_twice_in_a_row_places_on_the_bench_node_and_releases_the_first_runs_caches():
    # An older run's node, its lease still running: smaller than the bench node, so best fit would choose it.
    older = fleet_services.node_create(name="bench-node-0ld").node
    fleet_services.node_register(
        node_id=older.pk, endpoint="127.0.0.1:20001", capacity={"device": 32 * GIB, "dram": 32 * GIB, "ssd": 32 * GIB}
    )

    first = set_up(num_caches=2, max_caches=5)
    node = Node.objects.get(pk=first.node_id)
    assert node.name == BENCH_NODE and node.state == NodeState.READY
    assert Node.objects.get(pk=older.pk).state == NodeState.CORDONED
    assert [c.state for c in Cache.objects.filter(pk__in=first.cache_ids)] == ["ready", "ready"]
    # A run that died after an attach: the cache stays provisioning on the node, holding its reservation.
    spec = KVCacheSpec("bench-model@1", 32, 8, 128, 16, "float16", "float16")
    stuck = cache_services.cache_attach(tenant_id=first.tenant_id, name="stuck", spec=spec, capacity={"device": GIB})
    assert stuck.node_id == first.node_id and stuck.state == "provisioning"

    second = set_up(num_caches=2, max_caches=5)
    assert second.node_id == first.node_id and second.tenant_id != first.tenant_id
    assert second.released == 3  # the first run's two ready caches and the stuck one
    assert set(Cache.objects.filter(tenant_id=first.tenant_id).values_list("state", flat=True)) == {"detached"}
    assert Node.objects.get(pk=second.node_id).device_reserved_bytes == 2 * GIB  # only the second run's
    issued = cache_services.data_token_issue(tenant_id=second.tenant_id, cache_id=second.cache_ids[0], access="read")
    assert issued.data_token.cache_id == Cache.objects.get(pk=second.cache_ids[0]).pk

    assert release_caches(node_id=second.node_id, tenant_id=second.tenant_id) == 2
    assert Node.objects.get(pk=second.node_id).device_reserved_bytes == 0


def test_percentile_is_the_nearest_rank_of_a_sorted_list():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 51 and percentile(values, 0.99) == 100
    assert percentile([3.0], 0.99) == 3.0
