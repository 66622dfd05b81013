"""The host DRAM tier: evicted full blocks are demoted, not dropped, and promoted back bit-exact."""

import pytest
import torch

from gpu_node.engine.block_hash import tokens_as_int32
from gpu_node.tiers.lower_tiers import LowerTiers
from tests.gpu_node.kv_fixtures import prefix_kv, tiny_cache


def seq(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def tiered_cache(num_blocks=4, dram_blocks=8, **spec):
    cache = tiny_cache(num_blocks=num_blocks, **spec)
    cache.attach_tiers(LowerTiers(dram_blocks * cache.spec.block_bytes))
    return cache


def fill_and_push_out(cache, first, second):
    """Put `first`, then `second` (as large as the pool): every block of `first` is evicted from the device."""
    cache.put(first, prefix_kv(cache.spec, first))
    cache.put(second, prefix_kv(cache.spec, second))


def test_evicted_blocks_are_demoted_to_dram_instead_of_dropped():
    cache = tiered_cache()
    first, second = seq(16, 100), seq(16, 500)
    fill_and_push_out(cache, first, second)
    assert cache.stats().num_evictions == 4
    assert cache.tiers.resident_bytes()["dram"] == 4 * cache.spec.block_bytes
    assert cache.lookup(first) == 16  # the match continues into DRAM
    cache.check_invariants()


def test_without_tiers_evicted_blocks_are_gone():
    cache = tiny_cache(num_blocks=4)
    fill_and_push_out(cache, seq(16, 100), seq(16, 500))
    assert cache.lookup(seq(16, 100)) == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_promotion_is_bit_exact_and_leaves_dram(dtype):
    cache = tiered_cache(kv_dtype=dtype, storage_dtype=dtype)
    first, second = seq(16, 100), seq(16, 500)
    fill_and_push_out(cache, first, second)
    n, kv = cache.get(first)
    assert n == 16 and torch.equal(kv, prefix_kv(cache.spec, first))
    # `second` was pushed out to make room, and is now in DRAM; `first` left DRAM (DRAM is exclusive)
    assert cache.tiers.resident_bytes()["dram"] == 4 * cache.spec.block_bytes
    n, kv = cache.get(second)
    assert n == 16 and torch.equal(kv, prefix_kv(cache.spec, second))
    cache.check_invariants()
    cache.tiers.dram.check_invariants()


def test_quantized_storage_round_trips_through_dram_with_its_scales():
    cache = tiered_cache(kv_dtype="float32", storage_dtype="int8")
    first, second = seq(16, 100), seq(16, 500)
    cache.put(first, prefix_kv(cache.spec, first))
    _, before = cache.get(first)
    cache.put(second, prefix_kv(cache.spec, second))
    n, after = cache.get(first)
    assert n == 16 and torch.equal(after, before)


def test_promotion_continues_a_partly_resident_prefix_and_keeps_the_device_tail():
    cache = tiered_cache(num_blocks=6)
    first = seq(18, 100)  # 4 full blocks + a partial tail of 2
    cache.put(first, prefix_kv(cache.spec, first))
    cache.put(seq(16, 500), prefix_kv(cache.spec, seq(16, 500)))
    n, kv = cache.get(first[:16] + [1, 2])
    assert n == 16 and torch.equal(kv, prefix_kv(cache.spec, first[:16]))
    cache.check_invariants()


def test_dram_capacity_is_a_bound_and_its_overflow_is_dropped_lru_first():
    cache = tiered_cache(num_blocks=4, dram_blocks=2)
    for start in (100, 200, 300):
        cache.put(seq(16, start), prefix_kv(cache.spec, seq(16, start)))
    dram = cache.tiers.dram
    assert dram.bytes_resident == 2 * cache.spec.block_bytes <= dram.capacity_bytes
    dram.check_invariants()
    # the oldest sequence's first blocks went first (a chain's tail is evicted before its prefix)
    assert cache.lookup(seq(16, 100)) == 0
    assert cache.lookup(seq(16, 200)) == 8


def test_a_corrupt_dram_block_is_a_miss_and_counted():
    cache = tiered_cache()
    first = seq(16, 100)
    fill_and_push_out(cache, first, seq(16, 500))
    second_hash = cache.hasher.block_hashes(tokens_as_int32(first))[1]
    payload, _ = cache.tiers.dram._entries[second_hash]
    payload[7] ^= 0x40
    n, kv = cache.get(first)
    assert n == 4 and torch.equal(kv, prefix_kv(cache.spec, first[:4]))  # the run stops before the bad block
    assert cache.tiers.checksum_failures()["dram"] == 1
    assert second_hash not in cache.tiers.dram
    cache.check_invariants()


def test_wipe_zeroes_dram_payloads():
    cache = tiered_cache()
    fill_and_push_out(cache, seq(16, 100), seq(16, 500))
    payloads = [p for p, _ in cache.tiers.dram._entries.values()]
    resident = cache.wipe()
    assert resident == 8 * cache.spec.block_bytes
    assert all(not any(p) for p in payloads)
    assert cache.tiers.resident_bytes()["dram"] == 0
