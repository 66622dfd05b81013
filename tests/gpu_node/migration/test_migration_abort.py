"""migrate_abort on the source (gpu_node.migration.tasks.NodeMigration.abort): a migration the control plane failed
lifts the source's write fence (writes are taken again) and its sender never fences afterwards; a cache that moved
for good stays moved."""

import pytest

from gpu_node.agent.registry import CacheRegistry
from gpu_node.migration.fence import MovedError, fences_for
from gpu_node.migration.tasks import NodeMigration


@pytest.fixture
def migration():
    registry = CacheRegistry(device_capacity_bytes=1 << 20, device="cpu")
    return NodeMigration(registry=registry, node_id="node-1", listener=None, client_context=None)


def test_an_abort_lifts_the_fence_and_stops_the_sender_from_fencing_again(migration):
    fences = fences_for(migration.registry)
    assert fences.fence("cache-1", "10.0.0.2:9000", 2)
    with pytest.raises(MovedError):
        fences.check("cache-1", write=True)
    migration.abort("m-1", "cache-1")
    fences.check("cache-1", write=True)  # writes are taken again
    assert migration.aborted("m-1") and not migration.aborted("m-2")


def test_an_abort_after_the_cutover_leaves_the_cache_moved(migration):
    fences = fences_for(migration.registry)
    fences.moved("cache-1", "10.0.0.2:9000", 2)
    migration.abort("m-1", "cache-1")
    with pytest.raises(MovedError):
        fences.check("cache-1", write=False)
