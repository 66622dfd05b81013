"""Between vLLM's paged KV tensors and KCaaS's KV layout, and the token arithmetic of a vLLM connector: plain torch,
no vLLM import (the main venv tests it; kcaas/connectors/vllm.py uses it inside the engine).

vLLM hands a connector one tensor per attention layer, `[num_blocks, num_kv_heads, block_size, 2 * head_dim]`,
blocks at dim 0: each block is one contiguous slab of `2 * block_size * num_kv_heads * head_dim` elements. Where a
token's K and V sit inside the slab is the attention backend's business, and it is not what the tensor's shape says:

  * CPU_ATTN views the slab as `[num_kv_heads, 2, block_size, head_dim]` (K rows, then V rows, per head), but its
    cache-write kernel (`cpu_attn_reshape_and_cache`, ISA-specific: vec, vec16, amx, neon, ...) stores K with the
    head dimension outermost inside each (block, head), `[head_dim, block_size]` on AVX2/AVX-512 ("vec"), and in
    other packings on other ISAs; V stays token-major. Nothing in vLLM's Python views shows this: it lives in the
    C++ kernels (csrc/cpu/cpu_attn_*.hpp), which both write and read the cache in that order;
  * FLASH_ATTN and TRITON_ATTN (CUDA) write each token's row as its K then its V: `[..., :D]` and `[..., D:]`;
  * the MLA backends (CPU_MLA here; TRITON_MLA, FLASHMLA, FLASHINFER_MLA, CUTLASS_MLA, FLASH_ATTN_MLA on CUDA) keep
    one latent row per token, `[num_blocks, 1, block_size, kv_lora_rank + qk_rope_head_dim]`: kv_c_normed then k_pe
    (`concat_and_cache_mla`; CPU_MLA's `do_kv_cache_update` writes the same). KCaaS stores that row as one head
    of half its width (kcaas.spec.KVCacheSpec.latent): the K plane is the row's first half, the V plane its second,
    so a latent block is the "concat" layout of one head, and the row crosses unchanged.

So a `PagedLayout` carries, for one block, the flat offset in the slab of every (K/V, token, head, dim) element:
`offsets`, shaped `[2, block_size, num_kv_heads, head_dim]`. Every layout known today is affine within each of the
K and V planes (an offset is base + token x a + head x b + dim x c): then `planes` holds those numbers and gather and
scatter copy through strided views of vLLM's memory, one copy per plane and run of consecutive blocks, instead of
an element-by-element map (3-4x faster on the CPU backend's layout); any other permutation takes the map.
`PagedLayout.probed` takes the offsets from the backend itself:
it runs the backend's own cache-write op on a probe tensor with values that encode each element's position (small
integers, exact in every float dtype), reads back where each landed, and refuses a write that is not a permutation
within one block. `PagedLayout.of` derives it from a backend's documented views, for backends the engine cannot
probe here (the CUDA ones; their write kernels store token-major rows, as their views say).

KCaaS's layout is `[num_layers, 2, num_tokens, num_kv_heads, head_dim]` (kcaas/dataplane.py, the same bytes the
transformers connector and every other engine read). `gather` copies whole vLLM blocks out into it (a save keeps the
tokens it needs), `scatter` copies it into vLLM blocks: whole ones, and the head of the last one where the tokens end
inside it (the cache's blocks are finer than vLLM's: a hit ends on a cache block, and vLLM computes the rest of that
vLLM block). Both touch only the blocks named, and scatter only the slots of the tokens given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

LAYOUTS = ("cpu", "concat", "latent")
# vLLM attention backends (their get_name()) whose paged tensors the connector knows; any other is refused at start-up
# (a layout guessed wrong would load KV into the wrong places).
BACKEND_LAYOUTS = {
    "CPU_ATTN": "cpu",
    "FLASH_ATTN": "concat",
    "TRITON_ATTN": "concat",
    **dict.fromkeys(("CPU_MLA", "TRITON_MLA", "FLASHMLA", "FLASHINFER_MLA", "CUTLASS_MLA", "FLASH_ATTN_MLA"), "latent"),
}
# What to do about a backend the connector refuses, where something can be done.
BACKEND_HINTS = {
    "AMX_MLA": "vLLM prefers AMX_MLA for MLA models on CPUs with AMX; start it with --attention-backend CPU_MLA",
}

# A backend's own cache write, on a layer-shaped tensor: (layer [blocks, heads, block_size, 2 * head_dim],
# key [tokens, heads, head_dim], value [tokens, heads, head_dim], slot_mapping [tokens]) -> None; it views the layer
# exactly as the backend's forward does (kcaas/connectors/vllm.py builds it for CPU_ATTN).
CacheWrite = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
PROBE_BASE = 64  # probe values are digits 1..PROBE_BASE: integers exact in fp32, fp16 and bf16 (<= 256)
PROBE_BLOCKS = 2  # a probe writes two blocks, so a write that leaks across a block boundary shows


class LayoutProbeError(ValueError):
    """The backend's cache write is not a permutation of one block's elements: the connector cannot map it."""


@dataclass(frozen=True, slots=True)
class PagedLayout:
    """Where a backend keeps each element of one block (see the module docstring)."""

    kind: str
    num_kv_heads: int
    block_size: int
    head_dim: int
    # [2, block_size, num_kv_heads, head_dim] -> flat offset of that element in its block's slab (a permutation)
    offsets: torch.Tensor = field(repr=False, compare=False)
    probed_from_backend: bool = False  # True: `offsets` come from running the backend's own write (`probed`)
    # where `offsets` is affine in (token, head, dim) within each of the K and V planes (every layout known today):
    # per plane (base, token stride, head stride, dim stride), so a block is copied through strided views
    planes: tuple[tuple[int, int, int, int], ...] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in LAYOUTS:
            raise ValueError(f"unknown paged KV layout {self.kind!r} (known: {', '.join(LAYOUTS)})")
        expected = (2, self.block_size, self.num_kv_heads, self.head_dim)
        if tuple(self.offsets.shape) != expected or not _is_permutation(self.offsets.flatten()):
            raise ValueError(f"offsets must be a permutation of one block's {expected} elements")
        object.__setattr__(self, "planes", _affine_planes(self.offsets))

    @property
    def block_elements(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim

    @classmethod
    def of(cls, kind: str, layer: torch.Tensor) -> PagedLayout:
        """The layout a backend `kind` documents for `layer` ([blocks, kv_heads, block_size, 2 * head_dim]; a
        "latent" layer has one head, its rows latent_dim wide)."""
        heads, block_size, head_dim = _paged_dims(layer)
        if kind not in LAYOUTS:
            raise ValueError(f"unknown paged KV layout {kind!r} (known: {', '.join(LAYOUTS)})")
        if kind == "latent" and heads != 1:
            raise ValueError(f"a latent (MLA) layer has one row per token, [blocks, 1, block_size, width], got {heads}")
        slab = torch.arange(2 * block_size * heads * head_dim)
        if kind == "cpu":  # the backend's view: [heads, 2, block_size, head_dim]
            offsets = slab.view(heads, 2, block_size, head_dim).permute(1, 2, 0, 3)
        else:  # [heads, block_size, K|V]: each token's row is its K then its V (latent: kv_c_normed | k_pe)
            offsets = slab.view(heads, block_size, 2, head_dim).permute(2, 1, 0, 3)
        return cls(kind, heads, block_size, head_dim, offsets.contiguous())

    @classmethod
    def probed(cls, kind: str, layer: torch.Tensor, write: CacheWrite) -> PagedLayout:
        """The layout of `layer` as the backend's own cache write `write` lays it out: a probe of PROBE_BLOCKS
        blocks, layer's dtype and device, written once per base-PROBE_BASE digit of each element's index.
        Raises LayoutProbeError if the write leaves an element unwritten, writes a value it was not given, or
        puts an element of one block into another."""
        heads, block_size, head_dim = _paged_dims(layer)
        per_block = 2 * block_size * heads * head_dim
        total = PROBE_BLOCKS * per_block
        # index of every element, in KCaaS's order per block: [blocks, 2, block_size, heads, head_dim]
        index = torch.arange(total, device=layer.device).view(PROBE_BLOCKS, 2, block_size, heads, head_dim)
        found = torch.zeros(PROBE_BLOCKS, per_block, dtype=torch.long, device=layer.device)
        slots = torch.arange(PROBE_BLOCKS * block_size, device=layer.device)
        place = 1
        while place < total:
            digit = (index // place) % PROBE_BASE + 1
            probe = torch.full((PROBE_BLOCKS, heads, block_size, 2 * head_dim), -1.0, dtype=layer.dtype)
            probe = probe.to(layer.device)
            key, value = (digit[:, part].reshape(-1, heads, head_dim).to(layer.dtype) for part in (0, 1))
            write(probe, key.contiguous(), value.contiguous(), slots)
            written = probe.reshape(PROBE_BLOCKS, per_block).float()
            if not bool(((written >= 1) & (written <= PROBE_BASE) & (written == written.round())).all()):
                raise LayoutProbeError(f"the {kind} backend's cache write left elements unwritten or changed them")
            found += (written.long() - 1) * place
            place *= PROBE_BASE
        local = found - torch.arange(PROBE_BLOCKS, device=layer.device).view(-1, 1) * per_block
        if not all(_is_permutation(row) for row in local) or not bool((local == local[0]).all()):
            raise LayoutProbeError(f"the {kind} backend's cache write is not the same permutation within each block")
        offsets = torch.empty(per_block, dtype=torch.long, device=layer.device)
        offsets[local[0]] = torch.arange(per_block, device=layer.device)  # element index -> where it landed
        offsets = offsets.cpu().view(2, block_size, heads, head_dim)
        return cls(kind, heads, block_size, head_dim, offsets, probed_from_backend=True)


def _affine_planes(offsets: torch.Tensor) -> tuple[tuple[int, int, int, int], ...] | None:
    """Per K/V plane, (base, token stride, head stride, dim stride) such that offsets[p, t, h, d] == base + t *
    token stride + h * head stride + d * dim stride, or None where a plane is no such affine map."""
    _, bs, heads, dim = offsets.shape
    t, h, d = torch.arange(bs).view(-1, 1, 1), torch.arange(heads).view(1, -1, 1), torch.arange(dim).view(1, 1, -1)
    planes = []
    for plane in offsets:
        base = int(plane[0, 0, 0])
        strides = [int(plane[tuple(1 if i == axis else 0 for i in range(3))]) - base if n > 1 else 0
                   for axis, n in enumerate((bs, heads, dim))]  # fmt: skip
        if not torch.equal(plane, base + t * strides[0] + h * strides[1] + d * strides[2]):
            return None
        planes.append((base, strides[0], strides[1], strides[2]))
    return tuple(planes)


def _paged_dims(layer: torch.Tensor) -> tuple[int, int, int]:
    """(num_kv_heads, block_size, head_dim) of a paged layer; ValueError if it is not [blocks, heads, bs, 2 * dim]."""
    if layer.dim() != 4 or layer.shape[3] % 2:
        raise ValueError(
            f"a paged KV layer must be [blocks, kv_heads, block_size, 2 * head_dim], got {tuple(layer.shape)}"
        )
    return layer.shape[1], layer.shape[2], layer.shape[3] // 2


def _is_permutation(values: torch.Tensor) -> bool:
    """Whether `values` (1-D, integers) is a permutation of 0..len-1."""
    sorted_values = values.sort().values
    return bool(torch.equal(sorted_values.cpu(), torch.arange(len(values), dtype=sorted_values.dtype)))


def _slabs(layer: torch.Tensor, layout: PagedLayout) -> torch.Tensor:
    """The layer as [num_blocks, block_elements] (a view: every block is one contiguous slab)."""
    if not layer.is_contiguous():
        raise ValueError("a paged KV layer must be contiguous (one slab per block)")
    return layer.view(layer.shape[0], layout.block_elements)


def gather(
    layers: list[torch.Tensor], layout: PagedLayout, block_ids: list[int], out: torch.Tensor | None = None
) -> torch.Tensor:
    """KV of the tokens in `block_ids` (in order, whole blocks) as [num_layers, 2, tokens, kv_heads, head_dim]:
    a fresh tensor (or `out`) on the layers' device, independent of vLLM's blocks once this returns."""
    nb, bs, heads, dim = len(block_ids), layout.block_size, layout.num_kv_heads, layout.head_dim
    first = layers[0]
    if out is None:
        out = torch.empty((len(layers), 2, nb * bs, heads, dim), dtype=first.dtype, device=first.device)
    if layout.planes is not None:
        for index, layer in enumerate(layers):
            for at, k, v in _block_views(layer, layout, block_ids, nb * bs):
                n = k.shape[0] * k.shape[1]
                out[index, 0, at : at + n].view(k.shape).copy_(k)
                out[index, 1, at : at + n].view(v.shape).copy_(v)
        return out
    ids = torch.tensor(block_ids, dtype=torch.long, device=first.device)
    offsets = layout.offsets.to(first.device).flatten()
    for index, layer in enumerate(layers):
        picked = _slabs(layer, layout).index_select(0, ids).index_select(1, offsets)  # [nb, 2 * bs * heads * dim]
        out[index].view(2, nb, bs, heads, dim).copy_(picked.view(nb, 2, bs, heads, dim).transpose(0, 1))
    return out


def _block_views(layer: torch.Tensor, layout: PagedLayout, block_ids: list[int], tokens: int):
    """For each run of consecutive blocks in `block_ids` holding the first `tokens` tokens: (its first token, its
    K view, its V view), each view [blocks, tokens per block, heads, dim] over the layer's memory (strided, through
    `layout.planes`). A run ends inside a block only at the last token: that block is a run of its own, its first
    tokens only."""
    assert layout.planes is not None
    if not layer.is_contiguous():
        raise ValueError("a paged KV layer must be contiguous (one slab per block)")
    bs, elements, at = layout.block_size, layout.block_elements, 0
    for first, count in _runs(block_ids[: -(-tokens // bs)]):
        whole = min(count, (tokens - at) // bs)
        parts = [(first, whole, bs)] if whole else []
        if whole < count:
            parts.append((first + whole, 1, tokens - at - whole * bs))
        for block, blocks, per_block in parts:
            size = (blocks, per_block, layout.num_kv_heads, layout.head_dim)
            origin = layer.storage_offset() + block * elements
            k, v = (layer.as_strided(size, (elements, st, sh, sd), origin + base) for base, st, sh, sd in layout.planes)
            yield at, k, v
            at += blocks * per_block


def _runs(block_ids: list[int]):
    """(first block, count) of each run of consecutive ids, in order."""
    start = 0
    for i in range(1, len(block_ids) + 1):
        if i == len(block_ids) or block_ids[i] != block_ids[i - 1] + 1:
            yield block_ids[start], i - start
            start = i


def scatter(layers: list[torch.Tensor], layout: PagedLayout, block_ids: list[int], kv: torch.Tensor) -> None:
    """Write kv ([num_layers, 2, n, kv_heads, head_dim]) into the first n slots of the blocks `block_ids`, in order
    (n > (len(block_ids) - 1) * block_size): whole blocks, then, where n ends inside the last block, only its first
    n % block_size slots; the slots past n are left as they are (vLLM may have written its own tokens there)."""
    nb, bs, heads, dim = len(block_ids), layout.block_size, layout.num_kv_heads, layout.head_dim
    n = kv.shape[2] if kv.dim() == 5 else -1
    if tuple(kv.shape) != (len(layers), 2, n, heads, dim) or not (nb - 1) * bs < n <= nb * bs:
        raise ValueError(
            f"kv must be [{len(layers)}, 2, tokens, {heads}, {dim}] with tokens ending in the last of {nb} blocks of "
            f"{bs}, got {tuple(kv.shape)}"
        )
    first = layers[0]
    kv = kv.to(device=first.device, dtype=first.dtype)
    if layout.planes is not None:
        for index, layer in enumerate(layers):
            for at, k, v in _block_views(layer, layout, block_ids, n):
                count = k.shape[0] * k.shape[1]
                k.copy_(kv[index, 0, at : at + count].view(k.shape))
                v.copy_(kv[index, 1, at : at + count].view(v.shape))
        return
    whole = n // bs
    if whole:
        _scatter_blocks(layers, layout, block_ids[:whole], kv[:, :, : whole * bs])
    if n > whole * bs:
        _scatter_head_of_block(layers, layout, block_ids[whole], kv[:, :, whole * bs :])


def _scatter_blocks(layers: list[torch.Tensor], layout: PagedLayout, block_ids: list[int], kv: torch.Tensor) -> None:
    """Write kv (whole blocks: [num_layers, 2, len(block_ids) * block_size, heads, dim]) into `block_ids`."""
    nb, bs, heads, dim = len(block_ids), layout.block_size, layout.num_kv_heads, layout.head_dim
    first = layers[0]
    ids = torch.tensor(block_ids, dtype=torch.long, device=first.device)
    offsets = layout.offsets.to(first.device).flatten()
    slab = torch.empty((nb, layout.block_elements), dtype=first.dtype, device=first.device)
    for index, layer in enumerate(layers):
        canonical = kv[index].view(2, nb, bs, heads, dim).transpose(0, 1).reshape(nb, layout.block_elements)
        slab.index_copy_(1, offsets, canonical)
        _slabs(layer, layout).index_copy_(0, ids, slab)


def _scatter_head_of_block(layers: list[torch.Tensor], layout: PagedLayout, block_id: int, kv: torch.Tensor) -> None:
    """Write kv ([num_layers, 2, r, heads, dim], r < block_size) into the first r slots of block `block_id` only."""
    r = kv.shape[2]
    offsets = layout.offsets[:, :r].to(layers[0].device).flatten()  # [2, r, heads, dim]: KCaaS's element order
    for index, layer in enumerate(layers):
        _slabs(layer, layout)[block_id].index_copy_(0, offsets, kv[index].reshape(-1))


def loadable_tokens(num_cached: int, num_prompt_tokens: int, block_size: int) -> int:
    """Of a prompt whose first `num_cached` tokens the store holds, how many a connector may load: whole cache blocks
    (`block_size`: the cache's, which divides vLLM's; the last one may end inside a vLLM block), and never the
    prompt's last token (vLLM recomputes it to have logits to sample from)."""
    usable = min(num_cached, num_prompt_tokens - 1)
    return max(usable, 0) // block_size * block_size


def savable_tokens(num_prompt_tokens: int, block_size: int) -> int:
    """The prompt tokens whose KV fills whole cache blocks (`block_size`: the cache's): what a connector saves once
    the prompt is computed (the last vLLM block it reads from may be partly filled)."""
    return num_prompt_tokens // block_size * block_size
