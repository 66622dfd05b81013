"""Hugging Face transformers connector: reuse cached prefixes with any causal LM whose cache is a DynamicCache
(LlamaForCausalLM and friends), through any store with KCaaS's get/put semantics — the in-process PagedKVCache or,
with the data-plane client, a remote cache.

    connector = HFConnector(model, store)
    out = connector.generate(input_ids, max_new_tokens=64, do_sample=False)   # like model.generate
    connector.last_reuse                                                        # tokens served from the cache

How it works: `store.get(prompt)` returns the longest cached prefix's KV; it becomes the DynamicCache passed to
`model.generate(cache=...)`, so the model prefills only the rest; afterwards the KV of the whole sequence (the prompt
and every generated token but the last, which was sampled and never run) is `store.put` — the store deduplicates
what it had. At least one prompt token is always run, so the model has logits to start generating from. Batch size 1
(a cache entry is one token sequence, so generate runs with an all-ones attention_mask: a prompt id equal to the pad
token is a token, not padding, and a mask that masks anything is refused); the model's dtype must be the store's kv
dtype, and the store's head_dim the model's (config.head_dim where the config has one, as Gemma's does, else
hidden_size // num_attention_heads).

Sliding-window models (Mistral, Qwen2 with use_sliding_window, Gemma 2/3 mixing sliding and full layers): the cache a
model builds for itself keeps only the last sliding_window - 1 tokens of a sliding layer. The connector always runs
the model with a full-length cache (`full_length_cache`: every layer keeps every token; the attention mask still
applies the window, so the logits are the model's own), and stores exactly the KV of the tokens it names: KV whose
length is not the token count raises ValueError before anything reaches the store. The price is memory: while it
runs, a sliding layer holds the whole sequence's KV, as a full layer does.

Read-only is said, never guessed (docs/sdk.md, "Token access levels": data tokens are `read` unless asked for
`readwrite`, on every surface). `HFConnector(model, store, read_only=True)` gets cached prefixes and never puts: a
decoder over a read-only data token. A connector not told `read_only=True` stores what it computes, so a store whose
`read_only` attribute is true (a data-plane client over a read token) is refused at construction with
ReadOnlyStore, naming both ways out, instead of a connector that silently never caches.

Latent attention (DeepseekV2/V3 and kin: a config with kv_lora_rank): the model caches one latent row per token and
layer, and the connector stores those rows in an 'mla' cache (kcaas.latent): a cached prefix is exactly the rows
the model computed. A store whose spec (its `spec` attribute) does not describe the model's KV (K/V heads for an
MLA model, another rank or head count, another number of layers) is refused at construction with
IdentityMismatch naming each field, before anything is read or written.

A vLLM KV connector maps onto the same two calls: `get_num_new_matched_tokens` -> lookup, the worker's
`start_load_kv` -> get into the paged buffer (or attention in place on the same GPU), `save_kv_layer`/request
finish -> put.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kcaas.spec import IdentityMismatch, KVCacheSpec
from kcaas.transformers_kv import full_length_cache, kv_from_dynamic_cache

# The fields that say how a model's KV is shaped (the rest of a spec says how a cache keeps it).
LAYOUT_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "attention", "kv_lora_rank", "qk_rope_head_dim")


class KVStore(Protocol):
    """get/put as PagedKVCache and kcaas.DataPlaneClient have them. A store may also have a `read_only` attribute:
    true means its puts are refused (e.g. a data-plane client over a read token)."""

    def get(self, tokens) -> tuple[int, torch.Tensor]: ...

    def put(self, tokens, kv: torch.Tensor) -> object: ...


@dataclass(frozen=True, slots=True)
class PrefixReuse:
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens whose KV came from the store (not recomputed)


class ReadOnlyStore(ValueError):
    """A connector that would store was handed a store that refuses puts (a read data token)."""


class HFConnector:
    def __init__(self, model, store: KVStore, *, read_only: bool = False):
        """`read_only`: get cached prefixes, never put.

        Raises: ReadOnlyStore when `read_only` is False and the store's `read_only` attribute is true (every put
        would be refused, and nothing would ever be cached); IdentityMismatch when the store's spec does not
        describe the model's KV."""
        _check_store_layout(model, store)
        if not read_only and getattr(store, "read_only", False):
            raise ReadOnlyStore(
                "the store is read-only (a data token with access 'read', the default): this connector would compute "
                "and never cache. Open the cache with access='readwrite' to store prefixes, or pass read_only=True "
                "to only reuse what others stored."
            )
        self.model = model
        self.store = store
        self.read_only = bool(read_only)
        self.last_reuse: PrefixReuse | None = None
        rank = getattr(getattr(model, "config", None), "kv_lora_rank", None)
        self.kv_lora_rank: int | None = rank if isinstance(rank, int) else None  # set: a latent (MLA) model

    def cached_prefix(self, input_ids: torch.Tensor):
        """(n, a full-length DynamicCache holding the KV of the first n prompt tokens, empty when n is 0);
        n <= len(prompt) - 1."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must be [1, seq_len] (one sequence), got {tuple(input_ids.shape)}")
        tokens = input_ids[0].cpu()
        num_cached, kv = self.store.get(tokens)
        num_cached = max(min(num_cached, len(tokens) - 1), 0)
        self.last_reuse = PrefixReuse(len(tokens), num_cached)
        if num_cached == 0:
            return 0, full_length_cache()
        if kv.shape[2] < num_cached:
            raise ValueError(f"the store answered {num_cached} cached tokens with the KV of {kv.shape[2]}")
        kv = kv[:, :, :num_cached].to(device=self.model.device, dtype=self.model.dtype)
        return num_cached, full_length_cache(kv, kv_lora_rank=self.kv_lora_rank)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, **generate_kwargs):
        """model.generate with the cached prefix reused and the new KV stored (unless read-only); returns the
        generate output (return_dict_in_generate is forced on: the output's cache is what gets stored)."""
        if "cache" in generate_kwargs or "past_key_values" in generate_kwargs:
            raise ValueError("the connector gives the model its cache: do not pass one")
        mask = generate_kwargs.get("attention_mask")
        if mask is None:
            # without a mask, generate takes every prompt id equal to the pad token for padding (and shifts the
            # positions after it): the KV would not be that of the tokens at their positions, which is what is stored
            generate_kwargs["attention_mask"] = torch.ones_like(input_ids)
        elif not bool(mask.all()):
            raise ValueError("attention_mask masks some tokens: a cache entry is one unpadded token sequence")
        _, cache = self.cached_prefix(input_ids)
        generate_kwargs["return_dict_in_generate"] = True
        output = self.model.generate(input_ids, cache=cache, **generate_kwargs)
        if not self.read_only:
            # the cache holds every token but the last generated one, which was sampled and never run
            self.store_sequence(output.sequences[0, :-1], output.cache)
        return output

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor):
        """One forward pass over the prompt with the cached prefix reused: the logits of the tokens actually run
        (the last len(prompt) - n), and the full cache, which is stored (unless read-only)."""
        num_cached, cache = self.cached_prefix(input_ids)
        output = self.model(input_ids[:, num_cached:], cache=cache, use_cache=True)
        if not self.read_only:
            self.store_sequence(input_ids[0], output.cache)
        return output

    def store_sequence(self, tokens: torch.Tensor, cache) -> None:
        """Put the KV `cache` holds under `tokens`: exactly the tokens it holds KV for, from the first, no more, no
        fewer. A cache that does not hold every token's KV (a sliding-window layer's) or holds the KV of another
        number of tokens raises ValueError, and nothing is stored."""
        if self.read_only:
            raise ValueError("this connector is read-only: it never puts")
        kv = kv_from_dynamic_cache(cache, latent=self.kv_lora_rank is not None)
        if kv.shape[2] != len(tokens):
            raise ValueError(f"the cache holds the KV of {kv.shape[2]} tokens, not of the {len(tokens)} tokens given")
        self.store.put(tokens.cpu(), kv.cpu())


def _check_store_layout(model, store) -> None:
    """Raise IdentityMismatch when the store has a spec whose KV layout is not the model's (fields as cache, model)."""
    spec = getattr(store, "spec", None) or getattr(store, "identity", None)  # PagedKVCache, DataPlaneClient
    config = getattr(model, "config", None)
    if not isinstance(spec, KVCacheSpec) or config is None:
        return
    expected = KVCacheSpec.from_hf_config(config, dtype=spec.kv_dtype, model_fingerprint=spec.model_fingerprint)
    fields = {name: pair for name, pair in spec.mismatches(expected).items() if name in LAYOUT_FIELDS}
    if fields:
        raise IdentityMismatch(fields)
