"""gpu_node.node_tasks.provision passes a cache's network_write_through to the registry as the keyword of that name
(CacheRegistry.provision(..., network_write_through: bool = False)); a registry that does not take the keyword yet
provisions a cache without write-through as before and refuses one with it (its promise could not be kept)."""

from __future__ import annotations

from gpu_node.node_tasks import NETWORK_WRITE_THROUGH_UNSUPPORTED, provision
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


class Recording:
    """A registry's provision signature, recording what it was given (the node's registry has its own tests)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def provision(
        self, *, cache_id, spec, capacity, hash_key, epoch, tenant_id="", ssd_key=None, network_write_through=False
    ):
        self.calls.append({"cache_id": cache_id, "capacity": capacity, "network_write_through": network_write_through})


class Older:
    """A registry from before the network tier: no network_write_through keyword."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def provision(self, *, cache_id, spec, capacity, hash_key, epoch, tenant_id="", ssd_key=None):
        self.calls.append(cache_id)


def _provision(registry, write_through: bool):
    return provision(
        registry, "c", SPEC.to_dict(), CAPACITY, b"k" * 32, 1, "t", b"s" * 32, network_write_through=write_through
    )


def test_the_flag_reaches_the_registry_as_its_keyword():
    registry = Recording()
    assert _provision(registry, True) == (True, "")
    assert _provision(registry, False) == (True, "")
    assert [call["network_write_through"] for call in registry.calls] == [True, False]
    assert registry.calls[0]["capacity"]["network"] == 8 * SPEC.block_bytes


def test_a_registry_without_the_keyword_refuses_write_through_only():
    registry = Older()
    assert _provision(registry, False) == (True, "")
    assert _provision(registry, True) == (False, NETWORK_WRITE_THROUGH_UNSUPPORTED)
    assert registry.calls == ["c"]
