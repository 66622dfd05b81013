"""Proof on a real model: a prefix served by the engine lets a tiny Llama continue exactly as a full recompute.

The model is Hugging Face transformers' LlamaForCausalLM, randomly initialised from a LlamaConfig, offline. Eager
attention on one thread makes the model's own arithmetic deterministic across sequence lengths, so any difference
comes from the cache: with fp32/fp16 storage the logits must be torch.equal; with int8/fp8 the served KV must stay
within the quantization bound of kcaas_kernels/quant.py element by element, and the logits within the bound documented
in docs/ARCHITECTURE.md (LOGIT_ERR_BOUND below, measured with margin on this model).
"""

import pytest
import torch
import transformers

from gpu_node.engine.paged_cache import PagedKVCache
from kcaas.spec import KVCacheSpec
from kcaas.transformers_kv import dynamic_cache_from_kv, kv_from_dynamic_cache
from kcaas_kernels.quant import error_bound

# max |logit difference| / max |logit| for quantized storage on this model (see docs/ARCHITECTURE.md)
LOGIT_ERR_BOUND = {"int8": 0.005, "fp8_e4m3": 0.02}  # measured 0.0015 and 0.0050
STORAGE_TO_TORCH = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


@pytest.fixture(scope="module", autouse=True)
def deterministic_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def tiny_llama(dtype: torch.dtype):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(config).to(dtype).eval(), config


def engine_for(config, kv_dtype: str, storage_dtype: str) -> PagedKVCache:
    spec = KVCacheSpec(
        model_fingerprint="tiny-llama-random@seed0",
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.hidden_size // config.num_attention_heads,
        block_size=16,
        kv_dtype=kv_dtype,
        storage_dtype=storage_dtype,
    )
    return PagedKVCache(spec, hash_key=b"tenant-cache-key" * 2, num_blocks=32, device="cpu")


def prompts():
    generator = torch.Generator().manual_seed(1)
    first = torch.randint(0, 128, (1, 37), generator=generator)
    # shares 30 tokens: one full block, then 14 tokens of the first prompt's second (full) block
    second = torch.cat([first[:, :30], torch.randint(0, 128, (1, 9), generator=generator)], dim=1)
    return first, second


@torch.no_grad()
def serve_and_continue(model, engine, first, second):
    """Prefill `first`, put its KV, get the cached prefix of `second`, run only the rest: (n, served kv, logits)."""
    prefill = model(first, use_cache=True)
    first_kv = kv_from_dynamic_cache(prefill.cache)
    result = engine.put(first[0], first_kv)
    assert result.num_cached_tokens == first.shape[1] and not result.out_of_space
    n, kv = engine.get(second[0])
    logits = model(second[:, n:], cache=dynamic_cache_from_kv(kv), use_cache=True).logits
    return n, kv, first_kv, logits


@pytest.mark.parametrize("dtype_name", ["float32", "float16"])
def test_cached_prefix_gives_bit_identical_logits(dtype_name):
    dtype = getattr(torch, dtype_name)
    model, config = tiny_llama(dtype)
    engine = engine_for(config, dtype_name, dtype_name)
    first, second = prompts()
    n, kv, first_kv, logits = serve_and_continue(model, engine, first, second)
    assert n == 30
    assert torch.equal(kv, first_kv[:, :, :n])
    with torch.no_grad():
        full = model(second).logits[:, n:]
    assert torch.equal(logits, full)
    assert engine.stats().num_hit_tokens == 30


@pytest.mark.parametrize("storage", ["int8", "fp8_e4m3"])
def test_quantized_prefix_stays_within_the_documented_bounds(storage):
    model, config = tiny_llama(torch.float32)
    engine = engine_for(config, "float32", storage)
    first, second = prompts()
    n, kv, first_kv, logits = serve_and_continue(model, engine, first, second)
    assert n == 30
    exact = first_kv[:, :, :n]
    assert ((kv - exact).abs() <= error_bound(exact, STORAGE_TO_TORCH[storage])).all()
    assert not torch.equal(kv, exact)  # it really was quantized
    with torch.no_grad():
        full = model(second).logits[:, n:]
    relative = ((logits - full).abs().max() / full.abs().max()).item()
    assert relative <= LOGIT_ERR_BOUND[storage], relative
