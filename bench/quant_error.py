"""Which int8 scale grouping for stored KV? Measures the error of three schemes on the same KV.

Schemes (all symmetric int8, fp32 scales):
- token_head  (ours): one scale per (token, head) over head_dim — slots are quantized independently, so partial
                      blocks can grow and copy-on-write can copy without requantizing anything;
- block_head        : one scale per (block of 16 tokens, head) — fewer scales, but a block's scale changes as it
                      fills, so appending a token would requantize the block;
- fp8_token_head    : fp8-e4m3 with our per (token, head) scale, for comparison;
- kivi              : keys per channel over a block's tokens, values per token (KIVI, 2024) — best for keys with
                      outlier channels, with the same append problem as block_head.
KV: (a) a tiny random-init Llama's real KV from transformers, (b) synthetic KV with the outlier-channel structure
of trained LLM keys (a few channels ~10x larger). Figures: relative RMS error of K, of V, and of a softmax attention
output for random queries. Usage: python -m bench.quant_error [--quick]
"""

from __future__ import annotations

import argparse
import json

import torch

BLOCK = 16


def quant_dequant(x: torch.Tensor, reduce_dims: tuple[int, ...]) -> torch.Tensor:
    amax = x.abs().amax(dim=reduce_dims, keepdim=True)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    return torch.round(x / scale).clamp(-127, 127) * scale


def by_blocks(x: torch.Tensor) -> torch.Tensor:
    """[S, H, D] -> [S/BLOCK, BLOCK, H, D] (S padded by repeating the last token)."""
    pad = (-x.shape[0]) % BLOCK
    if pad:
        x = torch.cat([x, x[-1:].expand(pad, *x.shape[1:])])
    return x.reshape(-1, BLOCK, *x.shape[1:])


def fp8_quant_dequant(x: torch.Tensor) -> torch.Tensor:
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


def scheme_error(keys: torch.Tensor, values: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    if scheme == "fp8_token_head":
        return fp8_quant_dequant(keys), fp8_quant_dequant(values)
    if scheme == "token_head":
        return quant_dequant(keys, (-1,)), quant_dequant(values, (-1,))
    n = keys.shape[0]
    kb, vb = by_blocks(keys), by_blocks(values)
    if scheme == "block_head":
        kq, vq = quant_dequant(kb, (1, 3)), quant_dequant(vb, (1, 3))
    else:  # kivi
        kq, vq = quant_dequant(kb, (1,)), quant_dequant(vb, (3,))
    return kq.reshape(-1, *keys.shape[1:])[:n], vq.reshape(-1, *values.shape[1:])[:n]


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [Q, H, D], k/v [S, H, D] -> [Q, H, D]."""
    scores = torch.einsum("qhd,shd->hqs", q, k) / k.shape[-1] ** 0.5
    return torch.einsum("hqs,shd->qhd", scores.softmax(-1), v)


def tiny_llama_kv(seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq_len + 8,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        out = model(torch.randint(0, 256, (1, seq_len)), use_cache=True)
    return [(layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)) for layer in out.cache.layers]


def outlier_kv(seq_len: int, heads: int = 8, dim: int = 128) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(seq_len, heads, dim, generator=generator)
    outliers = torch.randint(0, dim, (heads, 4), generator=generator)
    for head in range(heads):
        keys[:, head, outliers[head]] *= 10.0
    values = torch.randn(seq_len, heads, dim, generator=generator)
    return [(keys, values)]


def measure(layers, scheme: str) -> dict[str, float]:
    k_err = v_err = out_err = 0.0
    for keys, values in layers:
        kq, vq = scheme_error(keys, values, scheme)
        queries = torch.randn(8, keys.shape[1], keys.shape[2], generator=torch.Generator().manual_seed(1))
        queries = queries * keys.abs().mean()
        k_err += rel_rms(kq, keys)
        v_err += rel_rms(vq, values)
        out_err += rel_rms(attention(queries, kq, vq), attention(queries, keys, values))
    n = len(layers)
    return {"k": k_err / n, "v": v_err / n, "attn_out": out_err / n}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    seq_len = 257 if args.quick else 2049
    datasets = {"tiny_llama": tiny_llama_kv(seq_len), "outlier_keys": outlier_kv(seq_len)}
    figures: dict[str, float] = {}
    print(f"{'data':<14}{'scheme':<16}{'K rel rms':>12}{'V rel rms':>12}{'attn rel rms':>14}")
    for data_name, layers in datasets.items():
        for scheme in ("token_head", "block_head", "kivi", "fp8_token_head"):
            errors = measure(layers, scheme)
            print(f"{data_name:<14}{scheme:<16}{errors['k']:>12.2e}{errors['v']:>12.2e}{errors['attn_out']:>14.2e}")
            for name, value in errors.items():
                figures[f"{data_name}_{scheme}_{name}_rel_rms"] = value
    figures["chosen_scheme"] = "token_head"
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
