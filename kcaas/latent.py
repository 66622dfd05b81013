"""Latent (MLA) KV rows <-> the KV form a cache stores them in.

An MLA model (DeepSeek-V2/V3 and kin) caches one latent row per token per layer, `[kv_c_normed | k_pe]`
(kv_lora_rank + qk_rope_head_dim values; post-norm, post-RoPE), where other models cache per-head K and V. A cache
whose spec is 'mla' keeps each row as the two halves of one head: the K plane holds the row's first half, the V
plane its second (`[num_layers, 2, num_tokens, 1, latent_dim // 2]`), so every part of KCaaS that moves KV (pool,
block hashing, tiers, wire, migration, quantization with a scale per half row) carries latent KV unchanged, at
exactly num_layers * latent_dim elements per token. These two functions are the only conversion; connectors call
them at their edge.
"""

from __future__ import annotations

import torch


def kv_from_latent_rows(rows: torch.Tensor) -> torch.Tensor:
    """`rows` [num_layers, num_tokens, latent_dim] as a cache's KV [num_layers, 2, num_tokens, 1, latent_dim // 2].

    Raises: ValueError unless rows is 3-D with an even latent width."""
    if rows.dim() != 3 or rows.shape[2] % 2:
        raise ValueError(f"latent rows must be [num_layers, num_tokens, latent_dim] (even), got {tuple(rows.shape)}")
    layers, tokens, width = rows.shape
    return rows.reshape(layers, tokens, 2, 1, width // 2).permute(0, 2, 1, 3, 4).contiguous()


def latent_rows_from_kv(kv: torch.Tensor) -> torch.Tensor:
    """A latent cache's KV [num_layers, 2, num_tokens, 1, half] as rows [num_layers, num_tokens, 2 * half].

    Raises: ValueError unless kv has that shape."""
    if kv.dim() != 5 or kv.shape[1] != 2 or kv.shape[3] != 1:
        raise ValueError(f"latent KV must be [num_layers, 2, num_tokens, 1, latent_dim // 2], got {tuple(kv.shape)}")
    layers, _, tokens, _, half = kv.shape
    return kv.permute(0, 2, 1, 3, 4).reshape(layers, tokens, 2 * half)
