"""Test helpers: tiny specs and KV that depends on the whole prefix, as a real model's does.

`prefix_kv(spec, tokens)` gives position p a value determined by tokens[: p + 1] only, so two sequences that share a
prefix have bit-identical KV there and any block served for the wrong prefix, slot or tenant shows up as a mismatch.
"""

import numpy as np
import torch

from gpu_node.engine.paged_cache import TORCH_DTYPES, PagedKVCache
from kcaas.spec import KVCacheSpec

TEST_KEY = b"k" * 32


def tiny_spec(**overrides) -> KVCacheSpec:
    fields = dict(
        model_fingerprint="tiny-llama@test",
        num_layers=2,
        num_kv_heads=2,
        head_dim=4,
        block_size=4,
        kv_dtype="float32",
        storage_dtype="float32",
    )
    fields.update(overrides)
    return KVCacheSpec(**fields)


def tiny_latent_spec(**overrides) -> KVCacheSpec:
    """A tiny MLA spec: 6 latent + 2 rotary values per token and layer (stored as one head of 4, K and V planes)."""
    fields = dict(model_fingerprint="tiny-deepseek@test", num_layers=2, kv_lora_rank=6, qk_rope_head_dim=2)
    fields.update({"block_size": 4, "kv_dtype": "float32", **overrides})
    return KVCacheSpec.latent(**fields)


def tiny_cache(num_blocks=64, key=TEST_KEY, **spec_overrides) -> PagedKVCache:
    return PagedKVCache(tiny_spec(**spec_overrides), hash_key=key, num_blocks=num_blocks, device="cpu")


def prefix_kv(spec: KVCacheSpec, tokens) -> torch.Tensor:
    tokens = np.asarray(tokens, dtype=np.int64)
    rolling = np.cumsum((tokens + 1) * 2654435761 % 1000003) % 1000003  # depends on the whole prefix
    shape = (spec.num_layers, 2, len(tokens), spec.num_kv_heads, spec.head_dim)
    lane = torch.arange(int(np.prod([shape[0], shape[1], shape[3], shape[4]])), dtype=torch.float64)
    lane = lane.reshape(shape[0], shape[1], 1, shape[3], shape[4])
    pos = torch.as_tensor(rolling, dtype=torch.float64).reshape(1, 1, -1, 1, 1)
    kv = torch.sin(pos * 0.001 + lane * 0.37) * (1 + (lane % 3))
    return kv.to(TORCH_DTYPES[spec.kv_dtype])


def check_consistent(cache: PagedKVCache, *, holding: bool) -> None:
    """The cache's own invariants, block counts that add up, and (when nobody holds a block) no leaked block."""
    cache.check_invariants()
    stats = cache.stats()
    assert stats.num_used_blocks + stats.num_free_blocks == stats.num_blocks
    if not holding:
        assert stats.num_used_blocks == stats.num_cached_blocks  # nothing leaked
