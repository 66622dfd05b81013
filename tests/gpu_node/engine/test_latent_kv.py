"""Latent (MLA) KV in the engine: a latent spec's rows go in and come out bit-exact, cost exactly one row per token
and layer, are shared by prefix like any KV, and quantize within the documented bound (a scale per half row)."""

import pytest
import torch

from gpu_node.engine.paged_cache import PagedKVCache
from kcaas.latent import kv_from_latent_rows, latent_rows_from_kv
from tests.gpu_node.kv_fixtures import TEST_KEY, prefix_kv, tiny_latent_spec


def latent_rows(spec, tokens) -> torch.Tensor:
    """[num_layers, num_tokens, latent_dim] rows that depend on the whole prefix (prefix_kv's values, as rows)."""
    return latent_rows_from_kv(prefix_kv(spec, tokens))


def cache_for(spec, num_blocks=32) -> PagedKVCache:
    return PagedKVCache(spec, hash_key=TEST_KEY, num_blocks=num_blocks, device="cpu")


def test_rows_round_trip_through_the_cache_form():
    rows = torch.randn(3, 5, 576)
    kv = kv_from_latent_rows(rows)
    assert kv.shape == (3, 2, 5, 1, 288)
    assert torch.equal(kv[:, 0, :, 0], rows[:, :, :288]) and torch.equal(kv[:, 1, :, 0], rows[:, :, 288:])
    assert torch.equal(latent_rows_from_kv(kv), rows)


@pytest.mark.parametrize("bad", [torch.zeros(2, 5, 7), torch.zeros(5, 8)])
def test_rows_of_another_shape_are_refused(bad):
    with pytest.raises(ValueError):
        kv_from_latent_rows(bad)


def test_latent_rows_are_stored_and_served_bit_exact_and_shared_by_prefix():
    spec = tiny_latent_spec()
    cache = cache_for(spec)
    first, second = list(range(10)), list(range(6)) + [90, 91, 92]
    for seq in (first, second):
        cache.put(seq, kv_from_latent_rows(latent_rows(spec, seq)))
    for seq in (first, second):
        n, kv = cache.get(seq)
        assert n == len(seq) and torch.equal(latent_rows_from_kv(kv), latent_rows(spec, seq))
    assert cache.stats().block_bytes == spec.block_size * spec.num_layers * spec.latent_dim * 4  # one row, no more
    # first: 2 full blocks + a tail; second shares block 0 and adds a full block of its own + a tail
    assert cache.stats().num_cached_blocks == 5
    cache.check_invariants()


@pytest.mark.parametrize("storage", ["int8", "fp8_e4m3"])
def test_quantized_latent_rows_are_within_the_documented_bound_per_half_row(storage):
    from kcaas_kernels.quant import error_bound

    spec = tiny_latent_spec(storage_dtype=storage)
    cache = cache_for(spec)
    seq = list(range(9))
    exact = kv_from_latent_rows(latent_rows(spec, seq))
    cache.put(seq, exact)
    n, kv = cache.get(seq)
    torch_storage = torch.int8 if storage == "int8" else torch.float8_e4m3fn
    assert n == len(seq) and not torch.equal(kv, exact)
    assert ((kv - exact).abs() <= error_bound(exact, torch_storage)).all()  # rows of half a latent row each
    # one byte per value and a float32 scale per half row, per token and layer
    assert spec.storage_bytes_per_token == spec.num_layers * (spec.latent_dim + 2 * 4)
