"""The KVCacheSpec a vLLM engine's KV needs, from the model's Hugging Face config.json (torch-free, no vLLM): what
to attach a cache with before `vllm serve` uses it through kcaas.connectors.vllm.

    python -m kcaas.connectors.vllm_spec MODEL_DIR --block-size 128 > spec.json
    kcaas attach chat --spec spec.json --device-bytes 2GiB

The fingerprint is the one the connector derives from vLLM's own config: the model string exactly as given to
vLLM (a hub name or a directory) and its revision ("main" when none is given), "<model>@<revision>". Give vLLM the
same string, or set `model_fingerprint` in both places.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from kcaas.spec import KVCacheSpec

_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16", "half": "float16", "float": "float32"}


def fingerprint(model: str, revision: str | None = None) -> str:
    """What the connector calls the model: "<model string as given to vLLM>@<revision or main>"."""
    return f"{model}@{revision or 'main'}"


def _config_dict(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    return config.get("text_config", config)  # multimodal configs keep the language model's under text_config


def spec_from_hf_config(
    model: str,
    *,
    block_size: int,
    kv_dtype: str | None = None,
    storage_dtype: str | None = None,
    revision: str | None = None,
    model_fingerprint: str | None = None,
) -> KVCacheSpec:
    """The spec for `model` (a directory holding config.json): layers, KV heads and head size from the config (an
    explicit head_dim wins over hidden_size // num_attention_heads, as for Gemma and Qwen3), the dtype from
    `kv_dtype` or the config's torch_dtype/dtype. A config with a kv_lora_rank (DeepSeek-V2/V3 and kin: vLLM keeps
    one latent row per token and layer) gives the 'mla' spec of those rows."""
    config = _config_dict(model)
    dtype = kv_dtype or _DTYPES.get(str(config.get("torch_dtype") or config.get("dtype") or "float16"), "float16")
    return KVCacheSpec.from_hf_config(
        config,
        dtype=dtype,
        block_size=block_size,
        model_fingerprint=model_fingerprint or fingerprint(model, revision),
        storage_dtype=storage_dtype,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kcaas.connectors.vllm_spec", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="the model directory (holding config.json), the string you give vLLM")
    parser.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="tokens per KCaaS block; must divide vLLM's block size (CPU builds: 128, CUDA: 16)",
    )
    parser.add_argument("--kv-dtype", choices=sorted(set(_DTYPES.values())), help="default: the config's dtype")
    parser.add_argument("--storage-dtype", help="default: the kv dtype (int8/fp8_e4m3 quantize in the cache)")
    parser.add_argument("--revision")
    parser.add_argument("--model-fingerprint")
    args = parser.parse_args(argv)
    spec = spec_from_hf_config(
        args.model,
        block_size=args.block_size,
        kv_dtype=args.kv_dtype,
        storage_dtype=args.storage_dtype,
        revision=args.revision,
        model_fingerprint=args.model_fingerprint,
    )
    json.dump(spec.to_dict(), sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
