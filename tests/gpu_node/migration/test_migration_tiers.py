"""Migration of a cache whose blocks mostly live in its lower tiers (DRAM, SSD) over real mutual TLS 1.3.

Invariants checked: every block the source holds in any tier reaches the target (bit-exact reads of every sequence
there); the sender reads lower-tier blocks without promoting them (the source's device pool is unchanged by the
transfer); a block is never sent before its parent; a corrupted DRAM copy on the source is never sent.
"""

import numpy as np
import pytest
import torch

from gpu_node.agent.registry import CacheRegistry
from gpu_node.migration import block_transfer as bt
from tests.gpu_node.kv_fixtures import prefix_kv, tiny_latent_spec, tiny_spec
from tests.gpu_node.migration.test_migration_transfer import KEY, listener_for, pki, sender_for  # noqa: F401 (fixture)

SSD_KEY = b"s" * 32


def tiered_pair(tmp_path, spec, device_blocks=12, dram_blocks=16, ssd_blocks=400):
    """Source (epoch 1) and target (epoch 2) registries for cache c1, each with its own SSD directory."""
    capacity = {
        "device": device_blocks * spec.block_bytes,
        "dram": dram_blocks * spec.block_bytes,
        "ssd": ssd_blocks * spec.block_bytes,
    }
    engines = []
    for name, epoch in (("src", 1), ("dst", 2)):
        registry = CacheRegistry(device_capacity_bytes=1 << 30, device="cpu", ssd_dir=str(tmp_path / name))
        engines.append(
            (
                registry,
                registry.provision(
                    cache_id="c1", spec=spec, capacity=capacity, hash_key=KEY, epoch=epoch, ssd_key=SSD_KEY
                ).engine,
            )
        )
    return engines


def fill_many(engine, spec, num_seqs=14, length=36, seed=1):
    """Sequences of 9 full blocks each, then one sharing a prefix and ending in a partial tail (put last, so it is
    still on the device: partial tails are never demoted): far more blocks than the device pool holds."""
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, 50_000, size=length).astype(np.int32) for _ in range(num_seqs)]
    seqs.append(np.concatenate([seqs[0][:20], rng.integers(0, 50_000, size=9).astype(np.int32)]))
    for tokens in seqs:
        engine.put(tokens, prefix_kv(spec, tokens))
    if engine.tiers.ssd is not None:
        engine.tiers.ssd.flush()
    return seqs


def device_keys(engine):
    return {meta.key for meta in bt.snapshot(engine) if not meta.lower}


@pytest.mark.parametrize("spec", [tiny_spec(), tiny_latent_spec()], ids=["kv", "latent"])
def test_lower_tier_blocks_migrate_bit_exact(tmp_path, pki, spec):
    (_, src), (target, dst) = tiered_pair(tmp_path, spec)
    seqs = fill_many(src, spec)
    metas = bt.snapshot(src)
    lower = [meta for meta in metas if meta.lower]
    assert len(lower) > 3 * len(metas) // 4, "most blocks must live in DRAM/SSD for this test to mean anything"
    assert src.tiers.ssd.bytes_resident > 0 and src.tiers.dram.bytes_resident > 0
    before = device_keys(src)
    listener = listener_for(target, pki)
    try:
        stats = sender_for(src, listener, pki["src"]).run()
    finally:
        listener.stop()
    assert device_keys(src) == before  # read straight from the tiers: nothing promoted, nothing evicted
    assert_parent_first(src, stats.keys_sent)
    assert {m.key for m in bt.snapshot(dst)} == {m.key for m in metas}
    dst.tiers.ssd.flush()
    for tokens in reversed(seqs):  # the partial tail first: promotions for later reads may evict it (device only)
        n, kv = dst.get(tokens)
        assert n == len(tokens) and torch.equal(kv, prefix_kv(spec, tokens))  # bit-exact on the target
    dst.check_invariants()


def assert_parent_first(engine, keys_sent):
    """Every block was sent after its parent (or hangs off the root)."""
    parents = {meta.key: meta.parent for meta in bt.snapshot(engine)}
    seen = {bt.root_of(engine)}
    for key in keys_sent:
        assert parents[key] in seen
        seen.add(key)


def test_corrupt_dram_copy_is_not_sent(tmp_path):
    spec = tiny_spec()
    (_, src), _ = tiered_pair(tmp_path, spec, dram_blocks=16, ssd_blocks=0)
    fill_many(src, spec, num_seqs=3)
    victim = next(meta for meta in bt.snapshot(src) if meta.lower)
    payload, _ = src.tiers.dram._entries[victim.key]
    payload[0] ^= 0xFF  # bit rot in host memory
    assert bt.read_block(src, victim) is None  # verified before it goes on the wire: dropped, counted
    assert src.tiers.dram.num_checksum_failures == 1
    assert victim.key not in {meta.key for meta in bt.snapshot(src)}


def test_evicting_a_parent_demotes_its_cached_descendants_too():
    """A chain whose head is the LRU block (as on a target that received it parent first): evicting the head
    cascades its descendants out of the device index; they are demoted with it, not dropped."""
    from gpu_node.tiers.lower_tiers import LowerTiers
    from tests.gpu_node.kv_fixtures import tiny_cache

    cache = tiny_cache(num_blocks=4)
    cache.attach_tiers(LowerTiers(16 * cache.spec.block_bytes))
    chain = list(range(100, 116))  # 4 full blocks
    cache.put(chain, prefix_kv(cache.spec, chain))
    blocks = cache._state.blocks  # white box: the LRU order is set directly
    ids = [blocks.cached_hash_to_block[m.key] for m in bt.snapshot(cache)]
    blocks.touch(ids[1:])  # the head is now least recently used
    other = list(range(500, 504))
    cache.put(other, prefix_kv(cache.spec, other))  # evicts the head, cascading the other three
    assert len(cache.tiers.dram) == 4
    n, kv = cache.get(chain)
    assert n == 16 and torch.equal(kv, prefix_kv(cache.spec, chain))
    cache.check_invariants()
