"""CacheRegistry.usage_snapshot: per cache id, resident bytes now and counters since the process started that never
go down (a replaced or detached engine leaves its counts to the cache id); a cache no longer hosted is reported once
more with 0 resident bytes, closing its resident interval."""

import numpy as np

from gpu_node.agent.registry import CacheRegistry
from tests.gpu_node.kv_fixtures import prefix_kv, tiny_spec

SPEC = tiny_spec()
TOKENS = np.arange(100, 110, dtype=np.int32)  # 10 tokens


def _registry() -> CacheRegistry:
    return CacheRegistry(device_capacity_bytes=1 << 20, device="cpu")


def _provision(reg, epoch=1):
    return reg.provision(
        cache_id="c1", spec=SPEC, capacity={"device": 32 * SPEC.block_bytes}, hash_key=b"k" * 32, epoch=epoch
    )


def _entries(reg) -> dict:
    return {e["cache_id"]: e for e in reg.usage_snapshot()}


def test_writes_count_pool_bytes_and_reads_count_only_what_was_sent():
    reg = _registry()
    engine = _provision(reg).engine
    engine.put(TOKENS, prefix_kv(SPEC, TOKENS))
    engine.put(TOKENS, prefix_kv(SPEC, TOKENS))  # deduplicated: nothing written
    engine.get(TOKENS)  # an internal read (e.g. a put's prefix read-back): not served to anyone
    engine.count_served(7)
    entry = _entries(reg)["c1"]
    assert entry == {
        "cache_id": "c1",
        "device_bytes": engine.stats().bytes_resident,
        "dram_bytes": 0,
        "ssd_bytes": 0,
        "network_bytes": 0,
        "bytes_written_total": 10 * SPEC.storage_bytes_per_token,
        "tokens_served_total": 7,
    }
    assert engine.stats().num_hit_tokens == 10  # what the old counter would have billed


def test_a_detached_cache_is_reported_once_with_zero_bytes_and_its_counters_stay_monotonic():
    reg = _registry()
    engine = _provision(reg).engine
    engine.put(TOKENS, prefix_kv(SPEC, TOKENS))
    engine.count_served(4)
    assert reg.detach(cache_id="c1", epoch=1)
    closing = _entries(reg)["c1"]
    assert (closing["device_bytes"], closing["bytes_written_total"], closing["tokens_served_total"]) == (
        0,
        10 * SPEC.storage_bytes_per_token,
        4,
    )
    assert "c1" not in _entries(reg)  # reported once
    back = _provision(reg, epoch=2).engine  # hosted again by the same process: counting goes on from the totals
    back.count_served(1)
    again = _entries(reg)["c1"]
    assert (again["bytes_written_total"], again["tokens_served_total"]) == (10 * SPEC.storage_bytes_per_token, 5)


def test_a_newer_epoch_replacing_the_engine_keeps_the_old_counts():
    reg = _registry()
    _provision(reg).engine.count_served(3)
    _provision(reg, epoch=2).engine.count_served(2)
    assert _entries(reg)["c1"]["tokens_served_total"] == 5
