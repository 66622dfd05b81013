"""Removal at scale and in order: walks over chains are iterative (a 131,072-token prompt deletes, clears and
wipes), and a copy-on-write source is released before its prefix, so eviction stays tail first."""

import pytest

from tests.gpu_node.kv_fixtures import prefix_kv, tiny_cache

LONG = 131_072


@pytest.mark.parametrize("removal", ["delete", "clear", "wipe"])
def test_a_chain_of_8192_blocks_is_removed_without_recursion(removal):
    cache = tiny_cache(num_blocks=LONG // 16 + 1, block_size=16, num_layers=1, num_kv_heads=1, head_dim=1)
    tokens = list(range(LONG))
    cache.put(tokens, prefix_kv(cache.spec, tokens))
    assert cache.lookup(tokens) == LONG
    if removal == "delete":
        assert cache.delete(tokens) == LONG // 16
    elif removal == "clear":
        assert cache.clear() == LONG // 16
    else:
        cache.wipe()
        assert not cache.pool.any()
        return
    assert cache.lookup(tokens) == 0
    cache.check_invariants()


def test_a_copy_on_write_source_is_evicted_before_its_prefix():
    cache = tiny_cache(num_blocks=3)
    prefix = [1, 2, 3, 4]
    first, second = prefix + [7, 8], prefix + [7, 9]
    cache.put(first, prefix_kv(cache.spec, first))
    cache.put(second, prefix_kv(cache.spec, second))  # diverges inside the partial tail: a copy on write
    assert cache.stats().num_cow_copies == 1 and cache.stats().num_free_blocks == 0
    cache.put([50], prefix_kv(cache.spec, [50]))  # evicts the least recent leaf: second's copy
    cache.put([60], prefix_kv(cache.spec, [60]))  # then the copy's source, first's tail — not the prefix
    assert cache.lookup(prefix) == 4
    assert cache.stats().num_evictions == 2
    cache.check_invariants()
