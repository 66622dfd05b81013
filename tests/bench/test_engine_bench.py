"""The engine benchmark's own pieces: the synthetic trace, the batching simulation and its paged baseline, the
sha256 and hash-once-then-probe baselines, the half-cached prompts and the churned puts."""

import os

import numpy as np
import pytest
import torch

from bench.engine import (
    ChurnedPuts,
    _published_pool,
    half_cached_prompt,
    llama3_8b_like_spec,
    paged_reserved_tokens,
    prehashed_breakeven,
    prehashed_probe,
    prehashed_speedup,
    sha256_block_hashes,
    sha256_chain_lookup,
    sharegpt_like_trace,
    simulate_paged_batching,
)
from gpu_node.engine.paged_cache import PagedKVCache


def test_trace_has_the_sharegpt_means_fits_the_context_and_is_reproducible():
    trace = sharegpt_like_trace(3000, seed=7)
    assert abs(trace.prompt_tokens.mean() - 161) < 1 and abs(trace.output_tokens.mean() - 338) < 1
    assert trace.prompt_tokens.min() >= 1 and trace.output_tokens.min() >= 1
    assert (trace.prompt_tokens + trace.output_tokens).max() <= 2048
    assert np.percentile(trace.output_tokens, 99) > 4 * 338  # long-tailed
    again = sharegpt_like_trace(3000, seed=7)
    assert np.array_equal(trace.prompt_tokens, again.prompt_tokens)


def test_paged_batching_wastes_only_the_last_partial_block_and_beats_static_reservation():
    trace = sharegpt_like_trace(600, seed=1)
    result = simulate_paged_batching(trace, num_blocks=1024, block_size=16, warmup_steps=100)
    assert result["sim_steps_measured"] > 0
    # Each live sequence wastes under one block: at ~500 tokens per sequence that is ~1.5%.
    assert 0.95 < result["utilization"] <= 1.0
    assert result["pool_occupancy"] > 0.95
    assert result["static_prealloc_utilization"] < result["static_prealloc_round256_utilization"]
    assert result["static_prealloc_round256_utilization"] < result["utilization"]


def test_sha256_chain_lookup_counts_whole_blocks_up_to_the_first_miss():
    index: dict = {}
    stored = list(range(100, 148))  # three blocks of 16
    assert sha256_chain_lookup(stored, 16, index, fill=True) == 48
    assert sha256_chain_lookup(stored + [1, 2, 3], 16, index) == 48  # a partial tail is not hashed
    assert sha256_chain_lookup(stored[:20] + [0] * 28, 16, index) == 16
    assert sha256_chain_lookup([7] + stored[1:], 16, index) == 0


def test_published_pool_has_every_block_cached_and_evictable():
    pool = _published_pool(num_blocks=300, chain_blocks=128, block_size=4)
    assert pool.num_free_blocks == 0 and pool.num_evictable_blocks == 300 and pool.num_cached_blocks == 300
    pool.check_invariants(pool.block_parent[0])


def test_prehashed_probe_finds_what_the_sha256_chain_finds_from_hashes_made_once():
    index: dict = {}
    stored = list(range(100, 164))  # four blocks of 16
    sha256_chain_lookup(stored, 16, index, fill=True)
    hashes = sha256_block_hashes(stored + [5, 6], 16)
    assert len(hashes) == 4 and set(hashes) == set(index)  # the same chained hashes, the partial tail unhashed
    assert prehashed_probe(hashes, 16, index) == 64
    changed = stored[:40] + [0] + stored[41:]  # the third block differs: the first two hit
    assert prehashed_probe(sha256_block_hashes(changed, 16), 16, index) == 32 == sha256_chain_lookup(changed, 16, index)
    assert prehashed_probe([b"\x01" * 32] + hashes[1:], 16, index) == 0  # stops at the first miss


def test_prehashed_speedup_pays_hashing_once_and_a_whole_lookup_each_time():
    # engine 100 us per lookup; vLLM 270 us to hash the request once and 10 us per probe
    engine, hashing, probe = 100e-6, 270e-6, 10e-6
    assert prehashed_speedup(engine, hashing, probe, 1) == pytest.approx(2.8)
    assert prehashed_speedup(engine, hashing, probe, 3) == pytest.approx(1.0)
    assert prehashed_speedup(engine, hashing, probe, 10) == pytest.approx(0.37)
    assert prehashed_breakeven(engine, hashing, probe) == pytest.approx(3.0)
    assert prehashed_breakeven(5e-6, hashing, probe) is None  # cheaper than a bare probe: faster at any count


def test_half_cached_prompt_hits_exactly_its_first_half_in_the_engine():
    spec = llama3_8b_like_spec(num_layers=1, num_kv_heads=1, head_dim=1)
    cache = PagedKVCache(spec, hash_key=os.urandom(32), num_blocks=64, device=torch.device("cpu"))
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 1000, 16 * 8).astype(np.int32)
    cache.put(tokens, torch.zeros((1, 2, len(tokens), 1, 1), dtype=torch.float16))
    half = half_cached_prompt(tokens, 16, rng)
    assert len(half) == len(tokens) and np.array_equal(half[:64], tokens[:64]) and half[64] != tokens[64]
    assert cache.lookup(tokens) == 128 and cache.lookup(half) == 64
    odd = half_cached_prompt(tokens[:120], 16, rng)  # 7.5 blocks: the half rounds down to whole blocks
    assert cache.lookup(odd) == 48


def test_paged_reserved_tokens_rounds_each_sequence_up_to_whole_blocks():
    assert paged_reserved_tokens([1, 16, 17, 32, 33], 16) == 16 + 16 + 32 + 32 + 48
    assert paged_reserved_tokens([], 16) == 0


def test_paged_baseline_holds_the_same_blocks_as_the_engines_allocator_and_static_holds_far_more():
    trace = sharegpt_like_trace(600, seed=1)
    result = simulate_paged_batching(trace, num_blocks=1024, block_size=16, warmup_steps=100)
    # Without shared prefixes the engine's allocator can only match paging: its waste is the last partial block.
    assert result["paged_baseline_utilization"] == pytest.approx(result["utilization"], rel=1e-12)
    assert result["utilization_vs_paged_baseline"] == pytest.approx(1.0, rel=1e-12)
    assert result["utilization_vs_static_prealloc"] > 2
    assert result["utilization_vs_static_prealloc"] == pytest.approx(
        result["utilization"] / result["static_prealloc_utilization"]
    )


def test_churned_puts_evict_every_time_from_several_sequences_and_store_what_they_were_given():
    class Recorded(ChurnedPuts):
        def _put(self, tokens, kv):
            super()._put(tokens, kv)
            every.append(tokens)

    every: list = []
    spec = llama3_8b_like_spec(num_layers=2, num_kv_heads=1, head_dim=4)
    cache = PagedKVCache(spec, hash_key=os.urandom(32), num_blocks=20, device=torch.device("cpu"))
    churned = Recorded(cache, num_tokens=64, rng=np.random.default_rng(5))  # 4 blocks: 5 sequences fit
    kv = torch.randn((2, 2, 64, 1, 4)).to(torch.float16)
    assert churned.fill(kv) == 5
    assert cache.stats().num_free_blocks == 0 and cache.stats().num_evictions == 20  # in steady state already
    several = 0
    for _ in range(20):
        before = [cache.lookup(tokens) for tokens in every]
        assert churned.put(kv, torch.device("cpu")) > 0
        after = [cache.lookup(tokens) for tokens in every[:-1]]
        several += sum(1 for b, a in zip(before, after) if a < b) >= 2
        n, out = cache.get(every[-1])
        assert n == 64 and torch.equal(out, kv)
    assert churned.evicted_per_put == [4] * 20  # every put evicts a whole sequence's worth of blocks
    # The hit before each put keeps first halves resident: most puts take blocks from two sequences or more.
    assert several >= 10
    cache.check_invariants()
