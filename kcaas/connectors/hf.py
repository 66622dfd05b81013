"""Hugging Face transformers connector: reuse cached prefixes with any causal LM whose cache is a DynamicCache
(LlamaForCausalLM and friends), through any store with KCaaS's get/put semantics — the in-process PagedKVCache or,
with the data-plane client, a remote cache.

    connector = HFConnector(model, store)
    out = connector.generate(input_ids, max_new_tokens=64, do_sample=False)   # like model.generate
    connector.last_reuse                                                        # tokens served from the cache

How it works: `store.get(prompt)` returns the longest cached prefix's KV; it becomes the DynamicCache passed to
`model.generate(cache=...)`, so the model prefills only the rest; afterwards the KV of the whole sequence (prompt and
generated tokens, as the model's cache holds them) is `store.put` — the store deduplicates what it had. At least one
prompt token is always run, so the model has logits to start generating from. Batch size 1 (a cache entry is one
token sequence); the model's dtype must be the store's kv dtype.

A vLLM KV connector maps onto the same two calls: `get_num_new_matched_tokens` -> lookup, the worker's
`start_load_kv` -> get into the paged buffer (or attention in place on the same GPU), `save_kv_layer`/request
finish -> put.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kcaas.transformers_kv import dynamic_cache_from_kv, kv_from_dynamic_cache


class KVStore(Protocol):
    def get(self, tokens) -> tuple[int, torch.Tensor]: ...

    def put(self, tokens, kv: torch.Tensor) -> object: ...


@dataclass(frozen=True, slots=True)
class PrefixReuse:
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens whose KV came from the store (not recomputed)


class HFConnector:
    def __init__(self, model, store: KVStore):
        self.model = model
        self.store = store
        self.last_reuse: PrefixReuse | None = None

    def cached_prefix(self, input_ids: torch.Tensor):
        """(n, DynamicCache of the first n prompt tokens or None); n <= len(prompt) - 1."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must be [1, seq_len] (one sequence), got {tuple(input_ids.shape)}")
        tokens = input_ids[0].cpu()
        num_cached, kv = self.store.get(tokens)
        num_cached = min(num_cached, len(tokens) - 1)
        self.last_reuse = PrefixReuse(len(tokens), max(num_cached, 0))
        if num_cached <= 0:
            return 0, None
        kv = kv[:, :, :num_cached].to(device=self.model.device, dtype=self.model.dtype)
        return num_cached, dynamic_cache_from_kv(kv)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, **generate_kwargs):
        """model.generate with the cached prefix reused and the new KV stored; returns the generate output
        (return_dict_in_generate is forced on: the output's cache is what gets stored)."""
        _, cache = self.cached_prefix(input_ids)
        generate_kwargs["return_dict_in_generate"] = True
        output = self.model.generate(input_ids, cache=cache, **generate_kwargs)
        self.store_sequence(output.sequences[0], output.cache)
        return output

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor):
        """One forward pass over the prompt with the cached prefix reused: the logits of the tokens actually run
        (the last len(prompt) - n), and the full cache, which is stored."""
        num_cached, cache = self.cached_prefix(input_ids)
        output = self.model(input_ids[:, num_cached:], cache=cache, use_cache=True)
        self.store_sequence(input_ids[0], output.cache)
        return output

    def store_sequence(self, sequence: torch.Tensor, cache) -> None:
        kv = kv_from_dynamic_cache(cache)
        self.store.put(sequence[: kv.shape[2]].cpu(), kv.cpu())
