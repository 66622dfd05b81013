"""The cache's block events (gpu_node/engine/block_events.py) against the pool's own index: replaying them gives
exactly the full blocks the cache holds, through puts, evictions, deletes and a wipe; batches are numbered and the
oldest go once the log's bytes are spent (a reader told it missed them)."""

import numpy as np
import torch

from gpu_node.engine.block_events import BlockEventLog
from gpu_node.engine.paged_cache import PagedKVCache
from kcaas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from kcaas.spec import KVCacheSpec

SPEC = KVCacheSpec("m", 1, 1, 4, 4, "float32", "float32")


def held(cache: PagedKVCache) -> set[bytes]:
    """The full blocks a reader of every event since seq 0 believes the cache holds."""
    blocks: set[bytes] = set()
    read = cache.events.read(0, 10_000)
    assert read.first_seq == 0 and [seq for seq, _ in read.batches] == list(range(read.next_seq))
    for _, payload in read.batches:
        for event in decode_batch(payload).events:
            if isinstance(event, BlockStored):
                blocks |= set(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                blocks -= set(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                blocks.clear()
    return blocks


def indexed(cache: PagedKVCache) -> set[bytes]:
    return set(cache._state.blocks.cached_hash_to_block)  # the pool's index itself


def test_replaying_the_events_gives_the_index_through_puts_evictions_deletes_and_a_wipe():
    cache = PagedKVCache(SPEC, hash_key=b"k" * 32, num_blocks=6, device="cpu")
    for seed in range(5):  # 6 blocks hold one and a half of these: every put evicts
        tokens = torch.randint(0, 1000, (14,), generator=torch.Generator().manual_seed(seed))
        cache.put(tokens, torch.randn(1, 2, 14, 1, 4))
        assert held(cache) == indexed(cache)
    cache.put(list(range(8)), torch.randn(1, 2, 8, 1, 4))
    cache.delete(list(range(8)))
    assert held(cache) == indexed(cache)
    cache.wipe()
    assert held(cache) == indexed(cache) == set()


def test_the_oldest_batches_go_once_the_bytes_are_spent_and_a_reader_learns_it_missed_them():
    log = BlockEventLog(4, b"root", max_bytes=200)
    for i in range(20):
        log.stored(bytes([i]) * 16, b"root", torch.arange(4).numpy())
        log.read(0, 1)  # seals one batch per block
    read = log.read(0, 100)
    assert read.next_seq == 20 and read.first_seq > 0 and read.batches[0][0] == read.first_seq
    assert sum(len(p) for _, p in read.batches) <= 200 + len(read.batches[0][1])


def held_by_medium(cache: PagedKVCache) -> dict[str, set[bytes]]:
    """What a reader of every event since seq 0 believes each medium holds; asserts each stored chain's parent was
    announced before it (a reader can name the tokens of every block it holds)."""
    media: dict[str, set[bytes]] = {}
    seen: set[bytes] = set()
    read = cache.read_events(0, 10_000)
    for _, payload in read.batches:
        for event in decode_batch(payload).events:
            if isinstance(event, BlockStored):
                assert event.parent_block_hash is None or event.parent_block_hash in seen
                assert len(event.token_ids) == len(event.block_hashes) * event.block_size
                media.setdefault(event.medium, set()).update(event.block_hashes)
                seen.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                media.setdefault(event.medium, set()).difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                media.clear()
    return {medium: blocks for medium, blocks in media.items() if blocks}


def tiers_hold(cache: PagedKVCache) -> dict[str, set[bytes]]:
    """What the device pool and each lower tier hold now (the tiers themselves)."""
    tiers = cache.tiers
    held = {"GPU": indexed(cache), "CPU": set(tiers.dram.hashes())}
    if tiers.ssd is not None:
        held["STORAGE"] = set(tiers.ssd.hashes())
    return {medium: blocks for medium, blocks in held.items() if blocks}


def test_every_tier_announces_what_it_gains_and_loses_in_its_own_medium(tmp_path):
    from gpu_node.tiers.lower_tiers import LowerTiers
    from gpu_node.tiers.ssd_store import SsdStore
    from tests.gpu_node.kv_fixtures import prefix_kv, tiny_cache

    cache = tiny_cache(num_blocks=4, key=b"h" * 32)
    block_bytes = cache.spec.block_bytes
    store = SsdStore(str(tmp_path), b"D" * 32, 64 * block_bytes, segment_bytes=8 * block_bytes)
    cache.attach_tiers(LowerTiers(3 * block_bytes, store))
    size = cache.block_size

    def put(tokens):
        cache.put(tokens, prefix_kv(cache.spec, tokens))

    conversations = [list(range(1000 * c, 1000 * c + 4 * size)) for c in range(4)]
    for tokens in conversations:  # each pushes the last out of the device: DRAM, then SSD
        put(tokens)
        assert held_by_medium(cache) == tiers_hold(cache)
    assert {"GPU", "CPU", "STORAGE"} <= set(held_by_medium(cache))
    assert cache.get(conversations[0])[0] == len(conversations[0])  # promoted back to the device
    assert held_by_medium(cache) == tiers_hold(cache)
    cache.delete(conversations[1][:size])  # the prefix and all under it, from every tier
    assert held_by_medium(cache) == tiers_hold(cache)
    assert not set().union(*held_by_medium(cache).values()) & set(
        cache.hasher.block_chain(np.asarray(conversations[1], dtype=np.int32)).hashes()
    )
    cache.wipe()
    assert held_by_medium(cache) == {}
