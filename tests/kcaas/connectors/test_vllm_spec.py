"""The spec to attach a cache with for a vLLM engine, from the model's config.json (kcaas/connectors/vllm_spec.py)."""

import json

from kcaas.connectors.vllm_spec import main, spec_from_hf_config
from kcaas.spec import KVCacheSpec


def model_dir(tmp_path, **config):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_gqa_heads_an_explicit_head_dim_and_a_text_config(tmp_path):
    llama = model_dir(
        tmp_path / "l",
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        hidden_size=768,
        torch_dtype="bfloat16",
    )
    spec = spec_from_hf_config(llama, block_size=16)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.kv_dtype) == (12, 4, 64, "bfloat16")
    assert spec.model_fingerprint == f"{llama}@main" and spec.storage_dtype == "bfloat16"
    gemma = model_dir(tmp_path / "g", num_hidden_layers=2, num_attention_heads=8, hidden_size=640, head_dim=256)
    assert spec_from_hf_config(gemma, block_size=128, kv_dtype="float32", revision="r1").head_dim == 256
    assert spec_from_hf_config(gemma, block_size=128, revision="r1").model_fingerprint == f"{gemma}@r1"
    nested = model_dir(
        tmp_path / "m",
        text_config={"num_hidden_layers": 3, "num_attention_heads": 4, "hidden_size": 128, "dtype": "float32"},
    )
    assert spec_from_hf_config(nested, block_size=16).num_kv_heads == 4  # no GQA: every head has its KV


def test_the_command_prints_a_spec_the_cli_attaches_with(tmp_path, capsys):
    path = model_dir(
        tmp_path,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=128,
        torch_dtype="float32",
    )
    assert main([path, "--block-size", "128", "--storage-dtype", "int8"]) == 0
    spec = KVCacheSpec.from_dict(json.loads(capsys.readouterr().out))
    assert (spec.block_size, spec.kv_dtype, spec.storage_dtype, spec.head_dim) == (128, "float32", "int8", 32)


def test_an_mla_config_gives_the_latent_spec_and_the_command_prints_it(tmp_path, capsys):
    path = model_dir(
        tmp_path,
        architectures=["DeepseekV3ForCausalLM"],
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        hidden_size=7168,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        torch_dtype="bfloat16",
    )
    spec = spec_from_hf_config(path, block_size=16)
    assert (spec.attention, spec.kv_lora_rank, spec.qk_rope_head_dim) == ("mla", 512, 64)
    assert spec.kv_bytes_per_token == 61 * 576 * 2
    assert main([path, "--block-size", "16"]) == 0
    assert KVCacheSpec.from_dict(json.loads(capsys.readouterr().out)) == spec
