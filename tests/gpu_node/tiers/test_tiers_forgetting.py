"""delete and clear reach every tier, durably: a forgotten prefix is a miss from device, DRAM and SSD, and a warm
restart does not bring it back (real tiers on a temp dir)."""

import numpy as np
import torch

from gpu_node.tiers.lower_tiers import LowerTiers
from gpu_node.tiers.ssd_store import SsdStore
from tests.gpu_node.kv_fixtures import prefix_kv, tiny_cache

DATA_KEY, HASH_KEY = b"D" * 32, b"h" * 32


def seq(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def tiered(directory=None, *, num_blocks=4, dram_blocks=8, ssd_blocks=64):
    cache = tiny_cache(num_blocks=num_blocks, key=HASH_KEY)
    block_bytes = cache.spec.block_bytes
    store = (
        SsdStore(str(directory), DATA_KEY, ssd_blocks * block_bytes, segment_bytes=8 * block_bytes)
        if directory
        else None
    )
    cache.attach_tiers(LowerTiers(dram_blocks * block_bytes, store))
    return cache


def put(cache, tokens):
    cache.put(tokens, prefix_kv(cache.spec, tokens))


def push_out(cache, start=5000):
    """Fill the device pool with unrelated blocks: everything else is demoted."""
    put(cache, seq(4 * cache.stats().num_blocks, start))


def restart(cache, directory):
    """A warm restart: the device pool and DRAM are gone, the SSD directory is rescanned."""
    cache.tiers.close()
    return tiered(directory, num_blocks=cache.stats().num_blocks, dram_blocks=0)


def first_on_ssd(directory):
    """A cache whose 16-token sequence `first` was pushed out of the device onto the SSD (DRAM holds nothing)."""
    cache = tiered(directory, dram_blocks=0)
    first = seq(16, 100)
    put(cache, first)
    push_out(cache)
    cache.tiers.ssd.flush()
    return cache, first


def chain_of(cache, tokens):
    return cache.hasher.block_chain(np.asarray(tokens, dtype=np.int32))


def misses(cache, tokens):
    n, kv = cache.get(tokens)
    return cache.lookup(tokens) == 0 and n == 0 and kv.shape[2] == 0


def test_delete_reaches_dram():
    cache = tiered()
    first = seq(16, 100)
    put(cache, first)
    push_out(cache)
    assert cache.lookup(first) == 16  # all four blocks now live in DRAM only
    assert cache.delete(first) == 4
    assert misses(cache, first)
    assert cache.tiers.resident_bytes()["dram"] == 0  # the unrelated blocks are on the device
    cache.check_invariants()


def test_delete_of_a_prefix_removes_what_is_chained_under_it_in_lower_tiers():
    cache = tiered(dram_blocks=16)
    shared = seq(8, 100)
    one, two = shared + seq(8, 300), shared + seq(8, 400)
    put(cache, one)
    put(cache, two)
    push_out(cache)
    assert cache.lookup(two) == 16
    cache.delete(shared)
    assert misses(cache, one) and misses(cache, two)
    put(cache, shared)  # the prefix stored again: what was under it stays forgotten
    assert cache.lookup(one) == 8 and cache.lookup(two) == 8


def test_delete_after_promotion_also_forgets_the_ssd_copy_and_survives_a_restart(tmp_path):
    cache, first = first_on_ssd(tmp_path)
    n, kv = cache.get(first)  # promoted back to the device; the SSD keeps its copy (inclusive)
    assert n == 16 and torch.equal(kv, prefix_kv(cache.spec, first))
    cache.delete(first)
    assert misses(cache, first)
    assert misses(restart(cache, tmp_path), first)


def test_delete_after_a_warm_restart_follows_the_durable_lineage(tmp_path):
    cache = tiered(tmp_path, dram_blocks=0)
    shared = seq(8, 100)
    one, two = shared + seq(8, 300), shared + seq(8, 400)
    put(cache, one)
    put(cache, two)
    push_out(cache)
    cache.tiers.ssd.flush()
    cache = restart(cache, tmp_path)
    assert cache.lookup(two) == 16  # rescanned
    cache.delete(one)  # forgets the shared first block and everything under it, `two`'s tail included
    put(cache, shared)
    assert cache.lookup(two) == 8 and cache.lookup(one) == 8
    cache = restart(cache, tmp_path)
    assert cache.lookup(two) <= 8


def test_clear_reaches_every_tier_durably(tmp_path):
    cache = tiered(tmp_path, dram_blocks=2)
    sequences = [seq(16, start) for start in (100, 200, 300)]
    for tokens in sequences:
        put(cache, tokens)
    cache.tiers.ssd.flush()
    assert cache.clear() >= 12
    assert all(misses(cache, tokens) for tokens in sequences)
    assert cache.tiers.resident_bytes() == {"dram": 0, "ssd": 0, "network": 0}
    cache = restart(cache, tmp_path)
    assert all(misses(cache, tokens) for tokens in sequences)


def test_a_delete_racing_a_promotion_never_brings_the_prefix_back():
    cache = tiered()
    first = seq(16, 100)
    put(cache, first)
    push_out(cache)
    fetch_run = cache.tiers.fetch_run

    def fetch_then_delete(hashes):  # the delete lands between the fetch (no lock) and the install
        payloads = fetch_run(hashes)
        cache.delete(first)
        return payloads

    cache.tiers.fetch_run = fetch_then_delete
    n, _ = cache.get(first)
    cache.tiers.fetch_run = fetch_run
    assert n == 0 and misses(cache, first)
    cache.check_invariants()


def test_eviction_counts_every_block_an_evicted_subtree_takes():
    cache = tiny_cache(num_blocks=4)
    put(cache, seq(16, 100))
    put(cache, seq(4, 900))  # one block wanted: the LRU block is the chain's tail
    assert cache.stats().num_evictions == 1
    cache.delete(seq(4, 900))
    cache.check_invariants()


def test_rescanned_ssd_blocks_keep_their_lineage_so_a_migration_lists_them(tmp_path):
    from gpu_node.migration.block_transfer import snapshot

    cache, first = first_on_ssd(tmp_path)
    cache = restart(cache, tmp_path)
    listed = [meta for meta in snapshot(cache) if meta.lower]
    assert len(listed) >= 4  # the four blocks of `first` (and the pushed-out ones' demotions, if any)
    by_key = {meta.key: meta for meta in listed}
    chain = chain_of(cache, first)
    for position in range(4):
        meta = by_key[bytes(chain[position])]
        assert meta.parent == bytes(chain.parent(position))
        assert meta.tokens.tolist() == first[position * 4 : (position + 1) * 4]


def test_a_block_written_through_to_ssd_is_forgotten_by_delete_before_and_after_a_restart(tmp_path):
    cache = tiered(tmp_path, dram_blocks=0, num_blocks=8)
    first = seq(16, 100)
    put(cache, first)
    chain = chain_of(cache, first)
    for position in range(4):  # as a migration target's journal does for each block it stores
        tokens = np.asarray(first[position * 4 : (position + 1) * 4], dtype=np.int32)
        assert cache.exchange.write_through(chain.parent(position), chain[position], tokens)
    cache.tiers.ssd.flush()
    assert cache.tiers.resident_bytes()["ssd"] == 4 * cache.spec.block_bytes  # inclusive: device and SSD
    cache.delete(first)
    assert misses(cache, first) and cache.tiers.resident_bytes()["ssd"] == 0
    assert misses(restart(cache, tmp_path), first)


def test_delete_forgets_a_lower_tier_block_on_its_own_chain_even_without_lineage(tmp_path):
    cache, first = first_on_ssd(tmp_path)
    chain = chain_of(cache, first)
    cache.tiers.lineage.remove(chain[2])  # as a record of the first SSD format would be: no lineage
    cache.delete(first)
    assert misses(cache, first)
    assert not cache.tiers.has(chain[2])
