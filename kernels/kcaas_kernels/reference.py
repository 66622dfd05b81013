"""Plain-torch implementations of the four kernel families: the test oracle AND the production CPU path.

Inputs are assumed validated by the public wrappers (kcaas_kernels/write_kv.py etc.); see kcaas_kernels/_common.py.

Layout (fixed, the engine depends on it):
  pool   [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]   block-major, contiguous
  scales [num_blocks, num_layers, 2, block_size, num_kv_heads] fp32        only for int8 / fp8 pools
  kv     [num_layers, 2, num_tokens, num_kv_heads, head_dim]               engine dtype
  slot = block_id * block_size + offset_in_block, -1 = skip (write) / zeros (read)

How write/read stay fast without Python loops over tokens or blocks: the pool is viewed as a 2-D table of rows.
A row is one (block, layer, K/V, slot) run of H*D contiguous elements, or, when the slot mapping covers whole
blocks in order (each run of block_size tokens fills one block from offset 0), one (block, layer, K/V) run of
block_size*H*D elements. Rows are then moved with a single ``index_select`` (read) or ``index_copy_`` (write),
which copy row by row instead of element by element; large whole blocks are written with one strided memcpy per run
of consecutive block ids (see LOOP_MIN_BLOCK_BYTES).
"""

import math

import torch

from kcaas_kernels._common import QUANT_DTYPES, scrub
from kcaas_kernels.quant import dequantize, quantize

# Whole blocks at least this large are written with one ``copy_`` per run of consecutive block ids (copied with one
# per block): a strided memcpy that torch runs on all cores, where CPU ``index_copy_`` is single-threaded and
# element-wise (~0.4-0.65x memcpy on this 2-core box). Each iteration moves >= 256 KiB, so the Python loop costs
# ~1%. Smaller blocks stay vectorised.
LOOP_MIN_BLOCK_BYTES = 256 << 10


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Same bytes, a dtype every indexing op supports (CPU ``index_copy_`` has no float8)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _rows_per_slot_run(slots: torch.Tensor, block_size: int) -> int:
    """block_size when ``slots`` (no -1) is a sequence of whole blocks, each filled in order; else 1."""
    num_tokens = slots.shape[0]
    if block_size == 1 or num_tokens % block_size != 0:
        return 1
    runs = slots.reshape(-1, block_size)
    starts = runs[:, :1]
    offsets = torch.arange(block_size, device=slots.device)
    if bool((starts % block_size == 0).all()) and bool((runs == starts + offsets).all()):
        return block_size
    return 1


def _row_ids(slots: torch.Tensor, num_layers: int, block_size: int, granule: int) -> torch.Tensor:
    """Row ids, ordered [layer, K/V, unit], of the units (granule consecutive slots) starting at slots[::granule].

    The pool is viewed as rows of granule*H*D elements; a slot's (layer, kv) run starts at element-row
    (block * num_layers * 2 + layer * 2 + kv) * block_size + offset in units of H*D.
    """
    units = slots[::granule]
    first_row = (units // block_size) * (num_layers * 2 * block_size) + units % block_size
    layer_kv = torch.arange(num_layers * 2, device=slots.device) * block_size
    return ((first_row.unsqueeze(0) + layer_kv.unsqueeze(1)) // granule).flatten()


def _scatter_rows(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor, granule: int) -> None:
    """dst viewed as rows of granule slots (pool: granule*H*D elements, scales: granule*H) <- src's rows."""
    row_len = granule * math.prod(dst.shape[4:])
    flat = _bits(src).reshape(-1, row_len)  # a copy when src is a strided slice
    _bits(dst).view(-1, row_len).index_copy_(0, rows, flat)
    scrub(flat, keep=(src,))


def _consecutive_runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(first source block index, first block id, length) of each run of consecutive ids in ``block_ids``."""
    runs, start = [], 0
    for j in range(1, len(block_ids) + 1):
        if j == len(block_ids) or block_ids[j] != block_ids[j - 1] + 1:
            runs.append((start, block_ids[start], j - start))
            start = j
    return runs


def _copy_whole_blocks(dst: torch.Tensor, src: torch.Tensor, block_ids: list[int]) -> None:
    """dst[block_ids[j]] <- tokens [j*bs, (j+1)*bs) of src [L, 2, T, ...]: one strided memcpy per run of
    consecutive block ids (the allocator hands out ascending runs), so a put of a long sequence into a fresh or
    cleared pool is one parallel copy, not one per block (each a parallel region that stalls when a core is busy)."""
    src_blocks = _bits(src).unflatten(2, (len(block_ids), dst.shape[3]))
    dst = _bits(dst)
    for j, block, length in _consecutive_runs(block_ids):
        dst[block : block + length].copy_(src_blocks[:, :, j : j + length].movedim(2, 0))


def write_kv_reference(
    kv: torch.Tensor, pool: torch.Tensor, scales: torch.Tensor | None, slot_mapping: torch.Tensor
) -> None:
    """pool[slot] = kv[:, :, token] for every token with slot >= 0 (quantized when the pool is int8/fp8)."""
    given = kv
    valid = slot_mapping >= 0
    slots = slot_mapping
    if not bool(valid.all()):
        kv, slots = kv[:, :, valid], slot_mapping[valid]
    if slots.numel() == 0:
        return
    if pool.dtype in QUANT_DTYPES:
        values, row_scales = quantize(kv, pool.dtype)
        targets = [(pool, values), (scales, row_scales)]
    else:
        targets = [(pool, kv.to(pool.dtype))]
    try:
        _write_targets(targets, slots, kv.shape[0], pool.shape[3])
    finally:
        scrub(kv, *(src for _, src in targets), keep=(given,))


def _write_targets(targets: list, slots: torch.Tensor, num_layers: int, block_size: int) -> None:
    pool = targets[0][0]
    granule = _rows_per_slot_run(slots, block_size)
    if granule == block_size:
        block_ids = (slots[::block_size] // block_size).tolist()
        # whole blocks: one strided copy per run of consecutive ids, when blocks are large or the runs are few (a
        # small put's one or two copies cost less than building row ids for a scatter)
        if pool[0].numel() * pool.element_size() >= LOOP_MIN_BLOCK_BYTES or len(_consecutive_runs(block_ids)) <= 2:
            for dst, src in targets:
                _copy_whole_blocks(dst, src, block_ids)
            return
    rows = _row_ids(slots, num_layers, block_size, granule)
    for dst, src in targets:
        _scatter_rows(dst, rows, src, granule)


def read_kv_reference(
    pool: torch.Tensor,
    scales: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    out_dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[:, :, token] = pool[slot] (dequantized, cast to out_dtype); zeros where slot == -1.

    ``out``: optional contiguous [L, 2, T, H, D] destination of out_dtype (else one is allocated).
    """
    _, num_layers, _, block_size, num_heads, head_dim = pool.shape
    num_tokens = slot_mapping.shape[0]
    out_shape = (num_layers, 2, num_tokens, num_heads, head_dim)
    out = torch.empty(out_shape, dtype=out_dtype, device=pool.device) if out is None else out
    if num_tokens == 0:
        return out
    valid = slot_mapping >= 0
    all_valid = bool(valid.all())
    slots = slot_mapping if all_valid else torch.where(valid, slot_mapping, 0)
    granule = _rows_per_slot_run(slots, block_size) if all_valid else 1
    rows = _row_ids(slots, num_layers, block_size, granule)
    row_len = granule * num_heads * head_dim
    if pool.dtype in QUANT_DTYPES:
        assert scales is not None, "a quantized pool has scales"
        q = _bits(pool).view(-1, row_len).index_select(0, rows).view(pool.dtype).view(out_shape)
        row_scales = scales.view(-1, granule * num_heads).index_select(0, rows).view(out_shape[:-1])
        dequantize(q, row_scales, out=out)
        scrub(q, row_scales)
    elif out_dtype == pool.dtype:
        torch.index_select(pool.view(-1, row_len), 0, rows, out=out.view(-1, row_len))
    else:
        gathered = pool.view(-1, row_len).index_select(0, rows)
        out.copy_(gathered.view(out_shape))
        scrub(gathered)
    if not all_valid:
        out[:, :, ~valid] = 0
    return out


# copy_blocks gathers/scatters small blocks in chunks of at most this many bytes: a bounded staging buffer that
# the allocator recycles (and, between devices, a bounded transfer).
COPY_CHUNK_BYTES = 8 << 20


def _copy_rows(src_rows: torch.Tensor, dst_rows: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    row_bytes = src_rows.shape[1] * src_rows.element_size()
    if row_bytes >= LOOP_MIN_BLOCK_BYTES:
        for src_id, dst_id in zip(src_ids.tolist(), dst_ids.tolist()):
            dst_rows[dst_id].copy_(src_rows[src_id])
        return
    src_ids, dst_ids = src_ids.to(src_rows.device), dst_ids.to(dst_rows.device)
    step = max(1, COPY_CHUNK_BYTES // row_bytes)  # a bounded staging buffer, recycled by the allocator
    for start in range(0, src_ids.shape[0], step):
        gathered = src_rows.index_select(0, src_ids[start : start + step])
        moved = gathered.to(dst_rows.device)
        dst_rows.index_copy_(0, dst_ids[start : start + step], moved)
        scrub(gathered, moved)


def copy_blocks_reference(
    src_pool: torch.Tensor,
    src_scales: torch.Tensor | None,
    dst_pool: torch.Tensor,
    dst_scales: torch.Tensor | None,
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
) -> None:
    """dst[dst_ids[i]] = src[src_ids[i]] for whole blocks (and their scales); pools may differ in device.

    Within one pool the caller guarantees no block is both a source and a destination, so the copies of one call
    never read what another wrote, in any order.
    """
    _copy_rows(
        _bits(src_pool).view(src_pool.shape[0], -1), _bits(dst_pool).view(dst_pool.shape[0], -1), src_ids, dst_ids
    )
    if src_scales is not None:
        assert dst_scales is not None, "both pools hold scales (quantized) or neither"
        _copy_rows(src_scales.view(src_scales.shape[0], -1), dst_scales.view(dst_scales.shape[0], -1), src_ids, dst_ids)


def _gather_layer(pool, scales, layer: int, k_or_v: int, pages: torch.Tensor, seq_len: int) -> torch.Tensor:
    """K or V of one sequence and layer as fp32 [seq_len, num_kv_heads, head_dim] (dequantized)."""
    num_heads, head_dim = pool.shape[4:]
    values = pool[:, layer, k_or_v].index_select(0, pages).reshape(-1, num_heads, head_dim)[:seq_len]
    if scales is None:
        return values.float()
    row_scales = scales[:, layer, k_or_v].index_select(0, pages).reshape(-1, num_heads)[:seq_len]
    return dequantize(values, row_scales)


def paged_decode_attention_reference(
    q: torch.Tensor,
    pool: torch.Tensor,
    scales: torch.Tensor | None,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """softmax(q K^T * sm_scale) V per sequence over its first seq_len cached tokens; fp32 math, q.dtype out."""
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = pool.shape[3], pool.shape[4]
    group = num_q_heads // num_kv_heads
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    out = torch.empty_like(q)
    for b, seq_len in enumerate(seq_lens.tolist()):
        pages = block_tables[b, : -(-seq_len // block_size)].to(torch.int64)
        k = _gather_layer(pool, scales, layer, 0, pages, seq_len)
        v = _gather_layer(pool, scales, layer, 1, pages, seq_len)
        q_grouped = q[b].float().view(num_kv_heads, group, head_dim)
        # Batched matmuls over kv heads: [H, G, D] @ [H, D, n] -> [H, G, n]; [H, G, n] @ [H, n, D] -> [H, G, D].
        scores = torch.matmul(q_grouped, k.permute(1, 2, 0)).mul_(sm_scale)
        probs = torch.softmax(scores, dim=-1)
        out[b] = torch.matmul(probs, v.transpose(0, 1)).reshape(num_q_heads, head_dim).to(q.dtype)
    return out
