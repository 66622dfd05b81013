"""PagedKVCache.put's input contract: KV that requires grad is stored (detached, exactly); KV the storage cannot hold
faithfully (non-finite into int8/fp8, finite values beyond a narrower storage dtype's range) is refused with
KVNotStorable before any byte moves; quantized KV read back obeys kcaas_kernels.error_bound at the adversarial edges."""

import pytest
import torch

from gpu_node.engine.kv_input import KVNotStorable
from gpu_node.engine.paged_cache import TORCH_DTYPES, PagedKVCache
from kcaas_kernels import QUANT_MAX_ABS_INPUT, error_bound
from tests.gpu_node.kv_fixtures import prefix_kv, tiny_cache
from tests.kernels.helpers import adversarial_rows, bits

TOKENS = list(range(100, 111))  # 11 tokens: two full blocks of 4 and a partial tail of 3
OTHER = list(range(500, 506))
QUANTIZED = ["int8", "fp8_e4m3"]
NAN, INF = float("nan"), float("inf")


def _state(cache: PagedKVCache):
    """Everything a refused put must leave as it was: stats, and the pool and scales bytes."""
    scales = bits(cache.scales).clone() if cache.scales is not None else None
    return cache.stats(), bits(cache.pool).clone(), scales


def _assert_unchanged(cache: PagedKVCache, before) -> None:
    stats, pool, scales = _state(cache)
    assert stats == before[0]
    assert torch.equal(pool, before[1])
    assert scales is None or torch.equal(scales, before[2])
    cache.check_invariants()


def _twin(cache: PagedKVCache) -> PagedKVCache:
    return tiny_cache(**{f: getattr(cache.spec, f) for f in ("kv_dtype", "storage_dtype", "head_dim")})


# ---- requires_grad --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("storage", ["float32", "float16", *QUANTIZED])
@pytest.mark.parametrize("grad_kind", ["leaf", "non_leaf"])
def test_kv_that_requires_grad_is_stored_detached_and_every_later_get_works(storage, grad_kind):
    cache = tiny_cache(storage_dtype=storage)
    twin = _twin(cache)  # the same puts without grad: what the cache must serve
    for c in (cache, twin):
        c.put(OTHER, prefix_kv(c.spec, OTHER))
    kv = prefix_kv(cache.spec, TOKENS)
    if grad_kind == "leaf":
        graded = kv.clone().requires_grad_(True)
    else:
        graded = kv.clone().requires_grad_(True) * 1.0  # exact, and carries a grad_fn
    cache.put(TOKENS, graded)
    twin.put(TOKENS, kv)
    assert graded.requires_grad  # the caller's tensor is not changed
    assert not cache.pool.requires_grad and cache.pool.grad_fn is None
    assert cache.scales is None or not cache.scales.requires_grad
    extended = TOKENS + [7, 8]  # extends the partial tail block in place
    cache.put(extended, prefix_kv(cache.spec, extended).requires_grad_(True))
    twin.put(extended, prefix_kv(twin.spec, extended))
    for seq in (TOKENS, OTHER, extended, TOKENS[:5]):
        n, got = cache.get(seq)
        twin_n, expected = twin.get(seq)
        assert n == twin_n == len(seq) and not got.requires_grad
        assert torch.equal(got, expected)
    if storage == "float32":
        assert torch.equal(cache.get(TOKENS)[1], kv)  # stored exactly
    cache.check_invariants()


# ---- non-finite KV into int8/fp8 ------------------------------------------------------------------------------------
@pytest.mark.parametrize("storage", QUANTIZED)
@pytest.mark.parametrize("bad", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", ["new_tail", "cached_prefix"])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "bfloat16"])
def test_non_finite_kv_into_quantized_storage_is_refused_and_nothing_changes(storage, bad, where, kv_dtype):
    cache = tiny_cache(storage_dtype=storage, kv_dtype=kv_dtype)
    cache.put(OTHER, prefix_kv(cache.spec, OTHER))
    cache.put(TOKENS[:6], prefix_kv(cache.spec, TOKENS[:6]))  # a partial block the refused put would extend
    before = _state(cache)
    kv = prefix_kv(cache.spec, TOKENS)
    token = 9 if where == "new_tail" else 2  # refused even where the tokens are cached already (deduplicated)
    kv[1, 1, token, 0, 3] = bad
    with pytest.raises(KVNotStorable, match=rf"non-finite.*\[layer 1, V, token {token}, head 0, dim 3\]") as info:
        cache.put(TOKENS, kv)
    assert isinstance(info.value, ValueError)
    _assert_unchanged(cache, before)
    assert cache.lookup(TOKENS) == 6 and cache.lookup(OTHER) == len(OTHER)
    result = cache.put(TOKENS, prefix_kv(cache.spec, TOKENS))  # good KV for the same tokens is taken
    assert (result.num_cached_tokens, result.num_written_tokens) == (11, 5)
    n, got = cache.get(TOKENS)
    assert n == 11 and got.isfinite().all()


@pytest.mark.parametrize("storage", QUANTIZED)
def test_quantized_storage_refuses_values_beyond_its_input_range(storage):
    """int8/fp8 take finite |x| <= QUANT_MAX_ABS_INPUT (the bf16 maximum): above it q * scale can overflow fp32."""
    cache = tiny_cache(storage_dtype=storage)
    before = _state(cache)
    kv = prefix_kv(cache.spec, TOKENS)
    kv[0, 0, 4, 1, 0] = -torch.finfo(torch.float32).max
    with pytest.raises(KVNotStorable, match="beyond"):
        cache.put(TOKENS, kv)
    _assert_unchanged(cache, before)
    kv[0, 0, 4, 1, 0] = -QUANT_MAX_ABS_INPUT  # the largest value taken
    cache.put(TOKENS, kv)
    n, got = cache.get(TOKENS)
    assert n == 11 and got.isfinite().all()
    assert ((got.double() - kv.double()).abs() <= error_bound(kv, TORCH_DTYPES[storage])).all()


# ---- unquantized storage ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kv_dtype,storage",
    [
        ("float32", "float32"),
        ("float16", "float16"),
        ("bfloat16", "bfloat16"),
        ("float16", "float32"),
        ("bfloat16", "float32"),
        ("float16", "bfloat16"),
        ("float32", "float16"),
        ("float32", "bfloat16"),
    ],
)
def test_non_finite_kv_in_float_storage_is_stored_as_is(kv_dtype, storage):
    cache = tiny_cache(kv_dtype=kv_dtype, storage_dtype=storage)
    kv = prefix_kv(cache.spec, TOKENS)
    kv[0, 0, 0, 0, :3] = torch.tensor([NAN, INF, -INF])
    kv[1, 1, 10, 1, 2] = NAN
    cache.put(TOKENS, kv)
    n, got = cache.get(TOKENS)
    assert n == 11
    assert torch.equal(got.isnan(), kv.isnan())
    finite = ~kv.isnan()
    if kv_dtype == storage or storage == "float32":
        assert torch.equal(got[finite], kv[finite])
    else:
        assert torch.equal(got.isinf(), kv.isinf())


@pytest.mark.parametrize(
    "kv_dtype,storage,beyond,largest,stored",
    [
        (
            "float32",
            "float16",
            65520.0,
            65519.99,
            65504.0,
        ),  # 65520 = max + half an ulp rounds to inf; 65519.99 does not
        ("float32", "float16", 1e30, 65504.0, 65504.0),
        ("float32", "bfloat16", torch.finfo(torch.float32).max, 3.3961e38, torch.finfo(torch.bfloat16).max),
        ("bfloat16", "float16", 1e5, 65280.0, 65280.0),  # 65280: the largest bf16 value below 65520
    ],
)
def test_finite_kv_beyond_a_narrower_storage_range_is_refused(kv_dtype, storage, beyond, largest, stored):
    cache = tiny_cache(kv_dtype=kv_dtype, storage_dtype=storage)
    cache.put(OTHER, prefix_kv(cache.spec, OTHER))
    before = _state(cache)
    kv = prefix_kv(cache.spec, TOKENS)
    kv[1, 0, 7, 1, 1] = -beyond
    with pytest.raises(KVNotStorable, match=f"beyond {storage}"):
        cache.put(TOKENS, kv)
    kv[0, 1, 3, 0, 0] = NAN  # NaN next to the overflowing value: still refused (the NaN itself is storable)
    with pytest.raises(KVNotStorable, match=f"beyond {storage}"):
        cache.put(TOKENS, kv)
    _assert_unchanged(cache, before)
    assert cache.lookup(TOKENS) == 0
    kv[1, 0, 7, 1, 1] = -largest  # rounds to the storage maximum: taken
    cache.put(TOKENS, kv)
    got = cache.get(TOKENS)[1]
    assert got[1, 0, 7, 1, 1] == -stored
    finite = ~kv.isnan()
    bound = error_bound(kv, TORCH_DTYPES[storage])
    assert ((got.double() - kv.double()).abs()[finite] <= bound[finite]).all()


def test_empty_and_wrong_kv_are_refused_as_before():
    cache = tiny_cache(storage_dtype="int8")
    with pytest.raises(ValueError, match="shape"):
        cache.put(TOKENS, torch.zeros(2, 2, 3, 2, 4))
    with pytest.raises(TypeError):
        cache.put(TOKENS, [[0.0]])
    assert cache.put([], torch.zeros(2, 2, 0, 2, 4)).num_cached_tokens == 0


# ---- the documented bound through the engine ------------------------------------------------------------------------
@pytest.mark.parametrize("storage", QUANTIZED)
@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [7, 13])
def test_put_then_get_of_adversarial_rows_stays_within_the_documented_bound(storage, kv_dtype, head_dim):
    """Tiny amax, subnormals, mixed magnitudes, amax at the dtype's top, ties: get returns finite KV within
    error_bound(kv, storage) (which includes the final rounding to the engine dtype), at an odd head_dim and
    3 heads, over a block boundary and a partial block."""
    cache = tiny_cache(storage_dtype=storage, kv_dtype=kv_dtype, head_dim=head_dim, num_kv_heads=3)
    rows = adversarial_rows(TORCH_DTYPES[kv_dtype], head_dim)
    per_token = 2 * 2 * 3  # layers x K/V x heads
    num_tokens = -(-rows.shape[0] // per_token) + 4  # and a few random tokens
    tokens = list(range(7, 7 + num_tokens))
    token_major = prefix_kv(cache.spec, tokens).permute(2, 0, 1, 3, 4).contiguous()
    token_major.view(-1, head_dim)[: rows.shape[0]] = rows
    kv = token_major.permute(1, 2, 0, 3, 4)  # engine layout [L, 2, T, H, D], non-contiguous
    cache.put(tokens, kv)
    n, got = cache.get(tokens)
    assert n == num_tokens and got.dtype == kv.dtype and got.isfinite().all()
    bound = error_bound(kv, TORCH_DTYPES[storage])
    assert bound.isfinite().all()
    assert ((got.double() - kv.double()).abs() <= bound).all()
