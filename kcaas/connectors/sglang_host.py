"""SGLang's host KV pool as KCaaS sees it (torch, no SGLang import): the KV layout it holds, and each page's bytes.

A page is stored as the bytes SGLang's own zero-copy API names for it (`get_page_buffer_meta(indices)`: a pointer and
a size per region, one region per page for MLA's page_first layouts, a K and a V region per page for MHA's page_first,
a K and a V region per layer for MHA's layer_first), concatenated in that order, and presented to the data plane as a
[num_layers, 2, page_size, num_kv_heads, head_dim] tensor of the pool's dtype: the byte count of the cache's KV for
page_size tokens. Regions are cut from the pool's own `kv_buffer` tensor (a region outside it is refused), so every
view is bounded by memory torch owns; a one-region page is read and written in place (zero copy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kcaas.connectors.vllm_session import ConnectorSetupError, EngineLayout
from kcaas.spec import KVCacheSpec, latent_head_shape

PAGE_SIZE_NAME = "SGLang's --page-size"  # the engine's block, as the messages name it
KV_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def engine_layout(pool, *, is_mla: bool, model_fingerprint: str) -> EngineLayout:
    """The KV layout SGLang's host pool holds (its page size as the engine's block size).

    Raises: ConnectorSetupError for a dtype KCaaS does not store or an MLA row of another width than its parts."""
    kv_dtype = KV_DTYPES.get(pool.dtype)
    if kv_dtype is None:
        raise ConnectorSetupError(f"the host pool's dtype {pool.dtype} is not one of {sorted(KV_DTYPES.values())}")
    if not is_mla:
        return EngineLayout(
            model_fingerprint,
            pool.layer_num,
            pool.head_num,
            pool.head_dim,
            kv_dtype,
            block_size=pool.page_size,
            block_name=PAGE_SIZE_NAME,
        )
    rank, rope = int(pool.kv_lora_rank), int(pool.qk_rope_head_dim)
    if int(getattr(pool, "kv_cache_dim", rank + rope)) != rank + rope:
        raise ConnectorSetupError("the MLA host pool packs its rows (kv_cache_dim != kv_lora_rank + qk_rope_head_dim)")
    heads, dim = latent_head_shape(rank, rope)
    return EngineLayout(
        model_fingerprint,
        pool.layer_num,
        heads,
        dim,
        kv_dtype,
        block_size=pool.page_size,
        block_name=PAGE_SIZE_NAME,
        attention="mla",
        kv_lora_rank=rank,
        qk_rope_head_dim=rope,
    )


@dataclass(frozen=True, slots=True)
class HostPages:
    """The pages of one host pool, in the cache's KV shape."""

    pool: Any  # SGLang's HostKVCache (get_page_buffer_meta, kv_buffer)
    spec: KVCacheSpec
    page_size: int

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (self.spec.num_layers, 2, self.page_size, self.spec.num_kv_heads, self.spec.head_dim)

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.spec.kv_bytes_per_token

    def regions(self, host_indices) -> list[list[torch.Tensor]]:
        """Per page of `host_indices` (page_size slots each), its uint8 views of the pool's memory, in order.

        Raises: ValueError when a region lies outside kv_buffer or a page's regions do not add up to its KV bytes."""
        num_pages = len(host_indices) // self.page_size
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        if num_pages == 0 or len(ptrs) % num_pages:
            raise ValueError(f"{len(ptrs)} buffer regions for {num_pages} pages")
        buffer = self.pool.kv_buffer
        flat = buffer.view(-1).view(torch.uint8)
        base, end = buffer.data_ptr(), buffer.data_ptr() + flat.numel()
        per_page = len(ptrs) // num_pages
        pages = []
        for p in range(num_pages):
            views = []
            for ptr, size in zip(ptrs[p * per_page : (p + 1) * per_page], sizes[p * per_page : (p + 1) * per_page]):
                if not (base <= ptr and ptr + size <= end):
                    raise ValueError("a page region lies outside the host pool's kv_buffer")
                views.append(flat[ptr - base : ptr - base + size])
            if sum(v.numel() for v in views) != self.page_bytes:
                raise ValueError(
                    f"a host page holds {sum(v.numel() for v in views)} bytes, the cache's {self.page_bytes}"
                )
            pages.append(views)
        return pages

    def as_page(self, raw: torch.Tensor) -> torch.Tensor:
        """A contiguous page's bytes (or a flat tensor of the KV dtype) as the cache's page tensor, without a copy."""
        dtype = getattr(torch, self.spec.kv_dtype)
        return raw.reshape(-1).view(torch.uint8).view(dtype).view(self.page_shape)

    def page_for_put(self, views: list[torch.Tensor]) -> torch.Tensor:
        """One page to send: the region itself when it is one, else its regions joined (one copy)."""
        return self.as_page(views[0] if len(views) == 1 else torch.cat(views))

    def staging(self, num_pages: int) -> torch.Tensor:
        """A buffer of num_pages pages' bytes (for pages of more than one region)."""
        return torch.empty((num_pages, self.page_bytes), dtype=torch.uint8)

    @staticmethod
    def scatter(raw: torch.Tensor, views: list[torch.Tensor]) -> None:
        """Copy a page's bytes (as received) into its regions, in order."""
        at = 0
        for view in views:
            view.copy_(raw[at : at + view.numel()])
            at += view.numel()
