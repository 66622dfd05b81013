"""KVCacheSpec.from_hf_config on real transformers configs: the KV layout a model's config implies, including models
whose explicit head_dim differs from hidden_size // num_attention_heads (Gemma, Qwen3)."""

import pytest
import torch
import transformers

from kcaas.spec import KVCacheSpec, SpecError


def named(config, name: str, commit: str | None = None):
    config._name_or_path = name
    if commit is not None:
        config._commit_hash = commit
    return config


def test_llama_with_gqa_takes_its_kv_heads_and_dtype():
    config = named(
        transformers.LlamaConfig(
            num_hidden_layers=4, hidden_size=256, num_attention_heads=8, num_key_value_heads=2, dtype=torch.bfloat16
        ),
        "meta-llama/Llama-3.2-1B",
    )
    spec = KVCacheSpec.from_hf_config(config)
    assert spec == KVCacheSpec("meta-llama/Llama-3.2-1B@main", 4, 2, 32, 16, "bfloat16", "bfloat16")


def test_qwen2_without_kv_heads_falls_back_to_attention_heads():
    config = transformers.Qwen2Config(num_hidden_layers=3, hidden_size=128, num_attention_heads=4)
    config.num_key_value_heads = None
    spec = KVCacheSpec.from_hf_config(config, dtype="float16", block_size=32, model_fingerprint="qwen2-tiny@v1")
    assert spec == KVCacheSpec("qwen2-tiny@v1", 3, 4, 32, 32, "float16", "float16")


@pytest.mark.parametrize(
    "config_class, kwargs",
    [
        (
            transformers.GemmaConfig,
            dict(hidden_size=3072, num_attention_heads=16, num_key_value_heads=16, head_dim=256),
        ),
        (transformers.Qwen3Config, dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128)),
    ],
)
def test_an_explicit_head_dim_wins_over_hidden_size_by_heads(config_class, kwargs):
    config = named(config_class(num_hidden_layers=2, **kwargs), "org/model", commit="abc123")
    spec = KVCacheSpec.from_hf_config(config, dtype="bfloat16")
    assert kwargs["hidden_size"] // kwargs["num_attention_heads"] != kwargs["head_dim"]
    assert (spec.head_dim, spec.num_kv_heads, spec.num_layers) == (kwargs["head_dim"], kwargs["num_key_value_heads"], 2)
    assert spec.model_fingerprint == "org/model@abc123"


def test_a_plain_dict_works_like_a_config():
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    values = {**config.to_dict(), "_name_or_path": "tiny", "torch_dtype": "float16"}
    assert KVCacheSpec.from_hf_config(values) == KVCacheSpec("tiny@main", 2, 2, 16, 16, "float16", "float16")


def test_what_the_config_cannot_say_is_a_spec_error():
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4)
    with pytest.raises(SpecError, match="model_fingerprint="):
        KVCacheSpec.from_hf_config(config)  # no name_or_path: the fingerprint must be given
    with pytest.raises(SpecError, match="pass dtype="):
        KVCacheSpec.from_hf_config({**config.to_dict(), "torch_dtype": "int4"}, model_fingerprint="m")
    with pytest.raises(SpecError, match="num_hidden_layers"):
        KVCacheSpec.from_hf_config({"num_attention_heads": 4, "hidden_size": 64}, model_fingerprint="m")


def deepseek_v3_config(**overrides):
    """DeepSeek-V3's attention shapes (61 layers, 128 heads, kv_lora_rank 512, rope 64, one MTP layer)."""
    values = dict(
        num_hidden_layers=61,
        hidden_size=7168,
        num_attention_heads=128,
        num_key_value_heads=128,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        num_nextn_predict_layers=1,
        dtype=torch.bfloat16,
    )
    values.update(overrides)
    return named(transformers.DeepseekV3Config(**values), "deepseek-ai/DeepSeek-V3")


def test_deepseek_v3_gives_a_latent_spec_of_one_576_wide_row_per_token_and_layer():
    spec = KVCacheSpec.from_hf_config(deepseek_v3_config())
    assert (spec.attention, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.latent_dim) == ("mla", 512, 64, 576)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (61, 1, 288)
    assert spec.kv_bytes_per_token == 61 * 1152  # 1,152 bytes per token per layer in bf16
    materialized = 61 * 128 * ((128 + 64) + 128) * 2  # per-head K (nope + rope) and V, bf16
    assert round(materialized / spec.kv_bytes_per_token) == 71


def test_the_mtp_layers_count_only_when_asked():
    assert KVCacheSpec.from_hf_config(deepseek_v3_config(), mtp_layers=True).num_layers == 62


def test_deepseek_v2_lite_is_latent_too():
    config = named(
        transformers.DeepseekV2Config(num_hidden_layers=27, kv_lora_rank=512, qk_rope_head_dim=64, q_lora_rank=None),
        "deepseek-ai/DeepSeek-V2-Lite",
    )
    spec = KVCacheSpec.from_hf_config(config, dtype="bfloat16")
    assert spec == KVCacheSpec.latent(
        model_fingerprint="deepseek-ai/DeepSeek-V2-Lite@main",
        num_layers=27,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        kv_dtype="bfloat16",
    )


def test_a_spec_dict_without_attention_fields_is_a_kv_spec_and_round_trips():
    kv = KVCacheSpec("m@1", 2, 2, 8, 16, "float16", "float16")
    old = {k: v for k, v in kv.to_dict().items() if k not in ("attention", "kv_lora_rank", "qk_rope_head_dim")}
    assert KVCacheSpec.from_dict(old) == kv
    latent = KVCacheSpec.latent(model_fingerprint="m@1", num_layers=2, kv_lora_rank=512, qk_rope_head_dim=64)
    assert KVCacheSpec.from_dict(latent.to_dict()) == latent
    assert set(kv.mismatches(latent)) >= {"attention", "kv_lora_rank", "qk_rope_head_dim", "num_kv_heads"}


@pytest.mark.parametrize(
    "fields",
    [
        dict(attention="mla", kv_lora_rank=511, qk_rope_head_dim=64, num_kv_heads=1, head_dim=287),
        dict(attention="mla", kv_lora_rank=512, qk_rope_head_dim=64, num_kv_heads=2, head_dim=288),
        dict(attention="mla", kv_lora_rank=0, qk_rope_head_dim=64, num_kv_heads=1, head_dim=32),
        dict(attention="mha", kv_lora_rank=512, qk_rope_head_dim=0),
        dict(attention="mqa"),
    ],
)
def test_an_inconsistent_attention_spec_is_refused(fields):
    base = dict(model_fingerprint="m@1", num_layers=2, num_kv_heads=2, head_dim=8, block_size=16)
    with pytest.raises(SpecError):
        KVCacheSpec(**{**base, "kv_dtype": "float16", "storage_dtype": "float16", **fields})
