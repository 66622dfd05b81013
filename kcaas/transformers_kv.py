"""Conversions between a Hugging Face `DynamicCache` and KCaaS's engine KV layout.

KCaaS moves KV as one tensor `[num_layers, 2, num_tokens, num_kv_heads, head_dim]` (K then V per layer);
transformers keeps, per layer, keys and values of `[batch, num_kv_heads, seq_len, head_dim]`. Only batch 1 is
converted: a cache entry is one token sequence.
"""

from __future__ import annotations

import torch


def kv_from_dynamic_cache(cache, num_tokens: int | None = None) -> torch.Tensor:
    """The first `num_tokens` (default: all) tokens of a batch-1 DynamicCache as [L, 2, S, H, D]."""
    layers = []
    for layer in cache.layers:
        keys, values = layer.keys, layer.values
        if keys.shape[0] != 1:
            raise ValueError(f"only batch size 1 converts to one KV sequence, got batch {keys.shape[0]}")
        stop = keys.shape[2] if num_tokens is None else num_tokens
        layers.append(torch.stack((keys[0, :, :stop].transpose(0, 1), values[0, :, :stop].transpose(0, 1))))
    return torch.stack(layers).contiguous()


def dynamic_cache_from_kv(kv: torch.Tensor):
    """A batch-1 DynamicCache holding `kv` ([L, 2, S, H, D]), ready to be passed as the model's cache."""
    from transformers import DynamicCache

    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"kv must be [num_layers, 2, num_tokens, num_kv_heads, head_dim], got {tuple(kv.shape)}")
    pairs = [
        (layer[0].transpose(0, 1).unsqueeze(0).contiguous(), layer[1].transpose(0, 1).unsqueeze(0).contiguous())
        for layer in kv
    ]
    return DynamicCache(pairs)
