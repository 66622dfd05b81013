import numpy as np
import pytest

from gpu_node.engine.block_hash import BlockHash
from gpu_node.engine.block_pool import BlockPool

ROOT = BlockHash(b"r" * 16)


def h(name: str) -> BlockHash:
    return BlockHash(name.encode().ljust(16, b"."))


def publish_chain(pool: BlockPool, names: list[str], block_size: int = 2) -> list[int]:
    """Allocate, publish (as full blocks) and release a chain; returns its block ids."""
    ids = pool.allocate(len(names))
    parent = ROOT
    for i, (block_id, name) in enumerate(zip(ids, names)):
        pool.cache_block(block_id, parent, np.arange(i, i + block_size, dtype=np.int32), h(name))
        parent = h(name)
    pool.release(ids[::-1])
    pool.check_invariants(ROOT)
    return ids


def test_fresh_pool_hands_out_low_ids_first_and_takes_them_back_in_batches():
    pool = BlockPool(8, 2)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.ref_cnt.tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert pool.num_free_blocks == 5 and pool.num_used_blocks == 3
    pool.release([2, 1, 0])  # uncommitted blocks go straight back to the free stack
    assert pool.num_free_blocks == 8
    pool.check_invariants(ROOT)


def test_cached_blocks_stay_until_pressure_then_lru_tail_of_chain_first():
    pool = BlockPool(4, 2)
    a = publish_chain(pool, ["a0", "a1"])
    b = publish_chain(pool, ["b0", "b1"])
    assert pool.num_free_blocks == 0 and pool.num_evictable_blocks == 4
    assert list(pool._evictable) == [a[1], a[0], b[1], b[0]]  # LRU first; on ties the tail first
    pool.touch([a[1], a[0]])  # a hit on chain a makes b the least recent
    assert list(pool._evictable) == [b[1], b[0], a[1], a[0]]
    got = pool.allocate(1)
    assert got == [b[1]] and pool.num_evictions == 1
    assert pool.get_cached_block(h("b1")) is None and pool.get_cached_block(h("b0")) == b[0]
    pool.release(got)
    pool.check_invariants(ROOT)


def test_evicting_a_prefix_also_frees_what_was_stored_under_it():
    pool = BlockPool(3, 2)
    a = publish_chain(pool, ["a0", "a1", "a2"])
    pool.touch([a[2], a[1]])  # make the head of the chain the LRU block: its children are unreachable once it goes
    got = pool.allocate(1)
    assert got == [a[0]]
    assert pool.num_cached_blocks == 0 and pool.num_free_blocks == 2  # descendants freed with it, not orphaned
    assert pool.num_evictions == 3  # every block removed counts: the evicted one and the two cascaded with it
    pool.release(got)
    pool.check_invariants(ROOT)


def test_held_blocks_are_never_evicted_and_allocation_says_when_it_runs_out():
    pool = BlockPool(3, 2)
    a = publish_chain(pool, ["a0", "a1", "a2"])
    pool.hold(a)
    assert pool.allocate(2) == []  # everything held: an empty result, not an exception
    pool.release(a[::-1])
    assert len(pool.allocate(2)) == 2


def test_uncache_of_a_held_block_dooms_it_until_its_reader_releases():
    pool = BlockPool(4, 2)
    a = publish_chain(pool, ["a0", "a1"])
    pool.hold([a[1]])
    assert pool.uncache([a[0]]) == 2
    assert pool.num_cached_blocks == 0
    assert pool.num_free_blocks == 3  # a0 freed now; a1 still read
    pool.check_invariants(ROOT)
    pool.release([a[1]])
    assert pool.num_free_blocks == 4
    pool.check_invariants(ROOT)


def test_best_child_finds_the_longest_common_token_prefix():
    pool = BlockPool(4, 4)
    ids = pool.allocate(2)
    pool.cache_block(ids[0], ROOT, np.array([1, 2, 3], dtype=np.int32), None)
    pool.cache_block(ids[1], ROOT, np.array([1, 2, 9, 9], dtype=np.int32), h("x"))
    assert pool.best_child(ROOT, np.array([1, 2, 3, 4], dtype=np.int32)) == (ids[0], 3)
    assert pool.best_child(ROOT, np.array([1, 2, 9], dtype=np.int32)) == (ids[1], 3)
    assert pool.best_child(ROOT, np.array([7], dtype=np.int32))[1] == 0
    assert pool.best_child(h("nobody"), np.array([1], dtype=np.int32)) == (-1, 0)


def test_releasing_an_unheld_block_is_a_bug_caught_by_an_assert():
    pool = BlockPool(2, 2)
    with pytest.raises(AssertionError):
        pool.release([0])
