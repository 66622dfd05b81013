"""Between vLLM's paged KV tensors and KCaaS's KV layout, and the token arithmetic of a vLLM connector: plain torch,
no vLLM import (the main venv tests it; kcaas/connectors/vllm.py uses it inside the engine).

vLLM hands a connector one tensor per attention layer, `[num_blocks, num_kv_heads, block_size, 2 * head_dim]`
(vLLM's standardized per-layer view, blocks at dim 0). What the last two dims mean depends on the attention
backend, so a `PagedLayout` names it:

  * "cpu"    (CPU_ATTN): each (block, head) holds the block's K rows then its V rows, i.e. the tensor is really
              `[num_blocks, num_kv_heads, 2, block_size, head_dim]` (the backend views it so and chunks dim 2);
  * "concat" (FLASH_ATTN, TRITON_ATTN on CUDA): each token's row is its K then its V, `[..., :D]` and `[..., D:]`.

KCaaS's layout is `[num_layers, 2, num_tokens, num_kv_heads, head_dim]` (kcaas/dataplane.py). `gather` copies
whole vLLM blocks out into it, `scatter` copies it into whole vLLM blocks; both touch only the blocks named, and
move whole blocks only (a connector loads and saves full blocks: the last, partial block of a prompt is always
computed by vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUTS = ("cpu", "concat")
# vLLM attention backends (their get_name()) whose paged tensors the connector knows; any other is refused at start-up
# (a layout guessed wrong would load KV into the wrong places).
BACKEND_LAYOUTS = {"CPU_ATTN": "cpu", "FLASH_ATTN": "concat", "TRITON_ATTN": "concat"}


@dataclass(frozen=True, slots=True)
class PagedLayout:
    """How one vLLM backend lays out a layer's paged KV tensor (see the module docstring)."""

    kind: str
    num_kv_heads: int
    block_size: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.kind not in LAYOUTS:
            raise ValueError(f"unknown paged KV layout {self.kind!r} (known: {', '.join(LAYOUTS)})")

    @classmethod
    def of(cls, kind: str, layer: torch.Tensor) -> PagedLayout:
        """The layout of `layer` ([num_blocks, num_kv_heads, block_size, 2 * head_dim]) for backend `kind`."""
        if layer.dim() != 4 or layer.shape[3] % 2:
            raise ValueError(
                f"a paged KV layer must be [blocks, kv_heads, block_size, 2 * head_dim], got {tuple(layer.shape)}"
            )
        return cls(kind, layer.shape[1], layer.shape[2], layer.shape[3] // 2)

    def k_and_v(self, layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the layer's K and V, each [num_blocks, num_kv_heads, block_size, head_dim] (no copy)."""
        if self.kind == "cpu":
            split = layer.view(layer.shape[0], self.num_kv_heads, 2, self.block_size, self.head_dim)
            return split[:, :, 0], split[:, :, 1]
        return layer[..., : self.head_dim], layer[..., self.head_dim :]


def gather(
    layers: list[torch.Tensor], layout: PagedLayout, block_ids: list[int], out: torch.Tensor | None = None
) -> torch.Tensor:
    """KV of the tokens in `block_ids` (in order, whole blocks) as [num_layers, 2, tokens, kv_heads, head_dim]:
    a fresh tensor (or `out`) on the layers' device, independent of vLLM's blocks once this returns."""
    nb, bs, heads, dim = len(block_ids), layout.block_size, layout.num_kv_heads, layout.head_dim
    first = layers[0]
    if out is None:
        out = torch.empty((len(layers), 2, nb * bs, heads, dim), dtype=first.dtype, device=first.device)
    ids = torch.tensor(block_ids, dtype=torch.long, device=first.device)
    for index, layer in enumerate(layers):
        for kv_index, part in enumerate(layout.k_and_v(layer)):
            picked = part.index_select(0, ids)  # [nb, heads, bs, dim]
            out[index, kv_index].view(nb, bs, heads, dim).copy_(picked.permute(0, 2, 1, 3))
    return out


def scatter(layers: list[torch.Tensor], layout: PagedLayout, block_ids: list[int], kv: torch.Tensor) -> None:
    """Write kv ([num_layers, 2, len(block_ids) * block_size, kv_heads, head_dim]) into the blocks `block_ids`."""
    nb, bs, heads, dim = len(block_ids), layout.block_size, layout.num_kv_heads, layout.head_dim
    expected = (len(layers), 2, nb * bs, heads, dim)
    if tuple(kv.shape) != expected:
        raise ValueError(f"kv must be {expected} to fill {nb} blocks, got {tuple(kv.shape)}")
    first = layers[0]
    ids = torch.tensor(block_ids, dtype=torch.long, device=first.device)
    kv = kv.to(device=first.device, dtype=first.dtype)
    for index, layer in enumerate(layers):
        for kv_index, part in enumerate(layout.k_and_v(layer)):
            blocks = kv[index, kv_index].view(nb, bs, heads, dim).permute(0, 2, 1, 3)  # [nb, heads, bs, dim]
            part.index_copy_(0, ids, blocks)


def loadable_tokens(num_cached: int, num_prompt_tokens: int, block_size: int) -> int:
    """Of a prompt whose first `num_cached` tokens the store holds, how many a connector may load: whole vLLM
    blocks only, and never the prompt's last token (vLLM recomputes it to have logits to sample from)."""
    usable = min(num_cached, num_prompt_tokens - 1)
    return max(usable, 0) // block_size * block_size


def savable_tokens(num_prompt_tokens: int, block_size: int) -> int:
    """The prompt tokens whose KV fills whole vLLM blocks: what a connector saves once the prompt is computed."""
    return num_prompt_tokens // block_size * block_size
