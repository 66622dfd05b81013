"""Conversions between a Hugging Face `DynamicCache` and KCaaS's engine KV layout.

KCaaS moves KV as one tensor `[num_layers, 2, num_tokens, num_kv_heads, head_dim]` (K then V per layer);
transformers keeps, per layer, keys and values of `[batch, num_kv_heads, seq_len, head_dim]`. Only batch 1 is
converted: a cache entry is one token sequence.

Sliding-window models (Mistral, Qwen2 with use_sliding_window, Gemma 2/3...): the cache a model builds from its
config keeps only the last `sliding_window - 1` tokens of each sliding layer, so it no longer holds the KV of the
sequence's first tokens and cannot be converted (`kv_from_dynamic_cache` refuses it). `full_length_cache()` is the
cache to run such a model with: built without the config, every layer is a plain DynamicLayer that keeps every
token, while the model's attention mask still applies the window, so the logits are the model's own.

Latent (MLA) models (DeepseekV2/V3): transformers caches, per layer, kv_c_normed as the keys `[batch, 1, seq_len,
kv_lora_rank]` and k_pe (post-RoPE) as the values `[batch, 1, seq_len, qk_rope_head_dim]`; the latent row is their
concatenation, `[kv_c_normed | k_pe]`, the order vLLM's MLA cache keeps, and a latent cache stores rows as
`kcaas.latent` says. Pass `kv_lora_rank` to build such a cache, `latent=True` to read one.
"""

from __future__ import annotations

import torch

from kcaas.latent import kv_from_latent_rows, latent_rows_from_kv


def kv_from_dynamic_cache(cache, num_tokens: int | None = None, *, latent: bool = False) -> torch.Tensor:
    """The first `num_tokens` (default: all) tokens of a batch-1 DynamicCache as [L, 2, S, H, D]; with `latent`
    (an MLA model's cache: keys kv_c_normed, values k_pe, one head each) the latent rows in a latent cache's form.

    Raises ValueError unless every layer holds the KV of every token the cache has seen (a sliding-window layer
    past its window does not) and at least `num_tokens` of them: the result is never shorter than asked.
    """
    layers, lengths = [], []
    for i, layer in enumerate(cache.layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor) or keys.dim() != 4:
            raise ValueError(f"cache layer {i} ({type(layer).__name__}) holds no KV of its own: it cannot be stored")
        if keys.shape[0] != 1:
            raise ValueError(f"only batch size 1 converts to one KV sequence, got batch {keys.shape[0]}")
        held, seen = keys.shape[2], layer.get_seq_length()
        if held != seen:
            raise ValueError(
                f"cache layer {i} ({type(layer).__name__}) holds {held} positions of KV for the {seen} tokens it has "
                "seen (a sliding-window layer keeps only its window): run the model with "
                "kcaas.transformers_kv.full_length_cache()"
            )
        lengths.append(held)
        stop = held if num_tokens is None else num_tokens
        if stop > held:
            raise ValueError(f"asked for the KV of {stop} tokens, cache layer {i} holds {held} tokens")
        layers.append(_layer_kv(keys[0, :, :stop], values[0, :, :stop], latent, i))
    if not layers:
        raise ValueError("the cache has no layers: nothing to convert")
    if len(set(lengths)) != 1:
        raise ValueError(f"cache layers hold different numbers of tokens ({lengths}): not one KV sequence")
    if latent:
        return kv_from_latent_rows(torch.stack(layers))
    return torch.stack(layers).contiguous()


def _layer_kv(keys: torch.Tensor, values: torch.Tensor, latent: bool, index: int) -> torch.Tensor:
    """One layer's [2, S, H, D] (K and V), or its latent rows [S, kv_lora_rank + rope] (keys then values)."""
    if not latent:
        return torch.stack((keys.transpose(0, 1), values.transpose(0, 1)))
    if keys.shape[0] != 1 or values.shape[0] != 1:
        raise ValueError(f"cache layer {index} holds {keys.shape[0]} heads: a latent (MLA) cache holds one")
    return torch.cat((keys[0], values[0]), dim=-1)


def full_length_cache(kv: torch.Tensor | None = None, *, kv_lora_rank: int | None = None):
    """A batch-1 DynamicCache whose every layer keeps every token (no sliding-window layers), holding `kv`
    ([L, 2, S, H, D]) if given, empty otherwise; pass it as the model's cache. With `kv_lora_rank`, `kv` is a
    latent cache's KV, split back into an MLA model's keys (the first kv_lora_rank values of each row) and values."""
    from transformers import DynamicCache

    if kv is None:
        return DynamicCache()  # without a config: layers are created as plain DynamicLayers on first use
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"kv must be [num_layers, 2, num_tokens, num_kv_heads, head_dim], got {tuple(kv.shape)}")
    if kv_lora_rank is not None:
        rows = latent_rows_from_kv(kv)
        pairs = [
            (r[None, None, :, :kv_lora_rank].contiguous(), r[None, None, :, kv_lora_rank:].contiguous()) for r in rows
        ]
    else:
        pairs = [
            (layer[0].transpose(0, 1).unsqueeze(0).contiguous(), layer[1].transpose(0, 1).unsqueeze(0).contiguous())
            for layer in kv
        ]
    return DynamicCache(pairs)  # no config: every layer a full-length DynamicLayer


def dynamic_cache_from_kv(kv: torch.Tensor):
    """A batch-1 DynamicCache holding `kv` ([L, 2, S, H, D]), ready to be passed as the model's cache (full length:
    see `full_length_cache`)."""
    return full_length_cache(kv)
