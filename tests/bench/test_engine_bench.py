"""The engine benchmark's own pieces: the synthetic trace, the batching simulation and the sha256 baseline."""

import numpy as np

from bench.engine import _published_pool, sha256_chain_lookup, sharegpt_like_trace, simulate_paged_batching


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
