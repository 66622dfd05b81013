"""gpu_node.agent.tasks.provision with the network tier's fields, on real registries: a node with a network store
provisions the tier with the cache's write-through; a node without one provisions network capacity without the tier
but refuses write-through (a put's durability promise could not be kept there)."""

from __future__ import annotations

from gpu_node.agent.registry import CacheRegistry
from gpu_node.agent.tasks import NETWORK_WRITE_THROUGH_UNSUPPORTED, provision
from gpu_node.tiers.guarded_store import GuardedStore
from gpu_node.tiers.object_store import MooncakeObjectStore
from kcaas.spec import KVCacheSpec

SPEC = KVCacheSpec(
    model_fingerprint="m@1",
    num_layers=1,
    num_kv_heads=1,
    head_dim=8,
    block_size=16,
    kv_dtype="float16",
    storage_dtype="float16",
)
CAPACITY = {"device": 4 * SPEC.block_bytes, "dram": 0, "ssd": 0, "network": 8 * SPEC.block_bytes}


def _provision(registry, cache_id: str, write_through: bool):
    return provision(
        registry, cache_id, SPEC.to_dict(), CAPACITY, b"k" * 32, 1, "t", b"s" * 32, network_write_through=write_through
    )


def test_a_node_with_a_store_provisions_the_tier_with_the_caches_write_through(network_store):
    store = GuardedStore(MooncakeObjectStore(network_store.master, network_store.metadata_url))
    registry = CacheRegistry(device_capacity_bytes=1 << 24, device="cpu", network_store=store)
    try:
        assert _provision(registry, "through", True) == (True, "")
        assert _provision(registry, "behind", False) == (True, "")
        through, behind = (registry.get(c).engine.tiers.network for c in ("through", "behind"))
        assert through.write_through and not behind.write_through
        assert through.capacity_bytes == behind.capacity_bytes == 8 * SPEC.block_bytes
    finally:
        store.close()


def test_a_node_without_a_store_refuses_write_through_only():
    registry = CacheRegistry(device_capacity_bytes=1 << 24, device="cpu")
    assert _provision(registry, "behind", False) == (True, "")
    assert registry.get("behind").engine.tiers is None  # no tier here: the node has no store
    assert _provision(registry, "through", True) == (False, NETWORK_WRITE_THROUGH_UNSUPPORTED)
    assert registry.get("through") is None
