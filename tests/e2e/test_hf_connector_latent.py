"""The transformers connector on a latent-attention (MLA) model, a tiny random-init DeepseekV3: the cache keeps one
latent row per token and layer, and a prefix served from it (ending inside a block too) gives the logits of the
model given the same prefix bit for bit, and greedy tokens equal to the model alone; a store whose spec does not
describe the model's KV is refused before anything moves."""

import pytest
import torch

from gpu_node.engine.paged_cache import PagedKVCache
from kcaas.connectors.hf import HFConnector
from kcaas.latent import latent_rows_from_kv
from kcaas.spec import IdentityMismatch, KVCacheSpec
from kcaas.transformers_kv import full_length_cache, kv_from_dynamic_cache
from tests.e2e.conftest import FP32_ROUNDING

pytestmark = pytest.mark.usefixtures("deterministic_threads")

KV_LORA_RANK, ROPE = 64, 16
BLOCK = 16


@pytest.fixture(scope="module")
def mla_model():
    import transformers

    config = transformers.DeepseekV3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=KV_LORA_RANK,
        qk_rope_head_dim=ROPE,
        qk_nope_head_dim=16,
        v_head_dim=16,
        first_k_dense_replace=2,  # dense MLPs: the test is about attention's cache
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        max_position_embeddings=256,
        initializer_range=0.2,  # sharp logits: clear greedy picks
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(config).to(torch.float32).eval()


def latent_spec(model, **overrides) -> KVCacheSpec:
    return KVCacheSpec.from_hf_config(
        model.config, dtype="float32", block_size=BLOCK, model_fingerprint="tiny-deepseek-v3@seed0", **overrides
    )


def store_for(spec: KVCacheSpec) -> PagedKVCache:
    return PagedKVCache(spec, hash_key=b"latent-connector" * 2, num_blocks=64, device="cpu")


def prefix_cache(model, donor: torch.Tensor, num_tokens: int):
    """The cache a served run starts from, made by the model alone: `donor`'s first num_tokens latent rows."""
    with torch.no_grad():
        kv = kv_from_dynamic_cache(model(donor, cache=full_length_cache(), use_cache=True).cache, latent=True)
    return full_length_cache(kv[:, :, :num_tokens].contiguous(), kv_lora_rank=KV_LORA_RANK)


def test_the_spec_of_an_mla_config_is_its_latent_rows(mla_model):
    spec = latent_spec(mla_model)
    assert (spec.attention, spec.kv_lora_rank, spec.qk_rope_head_dim) == ("mla", KV_LORA_RANK, ROPE)
    assert spec.kv_bytes_per_token == 2 * (KV_LORA_RANK + ROPE) * 4  # one fp32 row per token per layer, no more


def test_the_stored_rows_are_the_models_own_latent(mla_model):
    tokens = torch.randint(0, 128, (1, 2 * BLOCK), generator=torch.Generator().manual_seed(1))
    store = store_for(latent_spec(mla_model))
    HFConnector(mla_model, store).forward(tokens)
    num_cached, kv = store.get(tokens[0])
    assert num_cached == 2 * BLOCK
    with torch.no_grad():
        cache = mla_model(tokens, use_cache=True).cache
    for layer, rows in enumerate(latent_rows_from_kv(kv)):
        assert torch.equal(rows[:, :KV_LORA_RANK], cache.layers[layer].keys[0, 0])  # kv_c_normed
        assert torch.equal(rows[:, KV_LORA_RANK:], cache.layers[layer].values[0, 0])  # k_pe, post-RoPE


@pytest.mark.parametrize("shared", [2 * BLOCK, 2 * BLOCK + 7])  # a prefix of whole blocks, one ending inside a block
def test_a_shared_prefix_is_reused_exactly(mla_model, shared):
    system = torch.randint(0, 128, (1, shared), generator=torch.Generator().manual_seed(3))
    first = torch.cat([system, torch.tensor([[5, 6, 7]])], dim=1)
    second = torch.cat([system, torch.tensor([[9, 8, 7, 6]])], dim=1)
    connector = HFConnector(mla_model, store_for(latent_spec(mla_model)))
    kwargs = dict(max_new_tokens=6, do_sample=False, output_logits=True)

    connector.generate(first, **kwargs)
    served = connector.generate(second, **kwargs)
    reused = connector.last_reuse.num_cached_tokens
    assert reused >= 2 * BLOCK  # at least the shared whole blocks came from the cache, not the model

    with torch.no_grad():
        local = mla_model.generate(
            second, cache=prefix_cache(mla_model, first, reused), return_dict_in_generate=True, **kwargs
        )
        plain = mla_model.generate(second, return_dict_in_generate=True, **kwargs)
    assert torch.equal(served.sequences, local.sequences)  # the model given the same latent prefix: bit for bit
    assert all(torch.equal(a, b) for a, b in zip(served.logits, local.logits))
    assert torch.equal(served.sequences, plain.sequences)  # the model alone: the same greedy tokens
    assert all(torch.allclose(a, b, **FP32_ROUNDING) for a, b in zip(served.logits, plain.logits))


def test_a_repeated_prompt_gives_the_logits_of_the_model_alone(mla_model):
    tokens = torch.randint(0, 128, (1, 41), generator=torch.Generator().manual_seed(4))
    connector = HFConnector(mla_model, store_for(latent_spec(mla_model)))
    connector.forward(tokens)
    output = connector.forward(tokens)
    assert connector.last_reuse.num_cached_tokens == 40 and output.logits.shape[1] == 1
    with torch.no_grad():
        local = mla_model(tokens[:, :40], use_cache=True).cache
        incremental = mla_model(tokens[:, 40:], cache=local, use_cache=True).logits
    assert torch.equal(output.logits, incremental)


def mha_spec_for(model) -> KVCacheSpec:
    c = model.config
    return KVCacheSpec(
        "tiny-deepseek-v3@seed0", c.num_hidden_layers, c.num_attention_heads, 16, BLOCK, "float32", "float32"
    )


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (lambda m: mha_spec_for(m), "attention"),  # a K/V cache for an MLA model
        (
            lambda m: KVCacheSpec.latent(
                model_fingerprint="tiny-deepseek-v3@seed0",
                num_layers=2,
                kv_lora_rank=2 * KV_LORA_RANK,
                qk_rope_head_dim=ROPE,
                block_size=BLOCK,
                kv_dtype="float32",
            ),
            "kv_lora_rank",
        ),
        (
            lambda m: KVCacheSpec.latent(
                model_fingerprint="tiny-deepseek-v3@seed0",
                num_layers=3,
                kv_lora_rank=KV_LORA_RANK,
                qk_rope_head_dim=ROPE,
                block_size=BLOCK,
                kv_dtype="float32",
            ),
            "num_layers",
        ),
    ],
    ids=["mha-cache", "wrong-rank", "wrong-layers"],
)
def test_a_store_whose_spec_is_not_the_models_is_refused_naming_the_field(mla_model, spec, field):
    store = store_for(spec(mla_model))
    with pytest.raises(IdentityMismatch) as refused:
        HFConnector(mla_model, store)
    assert field in refused.value.fields
    assert store.get(torch.arange(2 * BLOCK))[0] == 0  # nothing was read or written
