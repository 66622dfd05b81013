"""paged_decode_attention: one query token per sequence attending over its paged KV, read in place from the pool.

Layout (explicit strides; head_dim strides are 1):
  q            [B, num_q_heads, D]                    engine dtype
  k/v cache    pool[:, layer, 0] / pool[:, layer, 1] = [num_blocks, block_size, num_kv_heads, D] (vLLM NHD)
  k/v scales   scales[:, layer, 0] / [:, layer, 1]   = [num_blocks, block_size, num_kv_heads] fp32 (int8/fp8)
  block_tables int32 [B, max_blocks]; token n of sequence b is slot n % block_size of block_tables[b, n // bs]
  seq_lens     int32 [B], each >= 1; only the first seq_len tokens are read (entries past them are never loaded)
  out          [B, num_q_heads, D] in q.dtype

GQA: q head h reads kv head h // (num_q_heads // num_kv_heads). A program owns one (sequence, kv head, split) and
all GROUP q heads sharing that kv head, so each K/V tile is loaded once per group. Scores are fp32 and
pre-scaled by sm_scale * log2(e) (exp2 softmax, online max/sum over TILE_N-token tiles; masked scores -inf).
Split-KV (flash-decoding): with NUM_SPLITS > 1 each program covers a contiguous, tile-aligned share of the
sequence and writes (normalized partial output, log2-sum-exp); a second kernel merges the splits.
"""

import math

import torch

from kcaas_kernels._common import (
    ENGINE_DTYPES,
    QUANT_DTYPES,
    check_index_tensor,
    check_pool,
    check_same_device,
    is_interpreted,
    resolve_impl,
    tl,
    triton,
)
from kcaas_kernels._triton_math import _cast_rne
from kcaas_kernels.reference import paged_decode_attention_reference

LOG2_E = 1.4426950408889634
# GROUP_PAD * TILE_N * BLOCK_D fp32 products live in registers at once. Sized with ptxas -v for sm_90 (~80-125
# registers per thread at 4 warps for G in 1..8, D 128); not yet tuned by timing on a GPU.
MAX_TILE_ELEMENTS = 2048
MAX_SPLITS = 64


@triton.jit
def _load_kv_tile(
    cache_ptr,
    scale_ptr,
    rows,
    scale_rows,
    valid,
    dim,
    HEAD_DIM: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    """[TILE_N, BLOCK_D] fp32 K or V of the tile's tokens (dequantized); zeros where not valid."""
    x = tl.load(cache_ptr + rows[:, None] + dim[None, :], mask=valid[:, None] & (dim[None, :] < HEAD_DIM), other=0.0)
    x = x.to(tl.float32)
    if QUANTIZED:
        x = x * tl.load(scale_ptr + scale_rows, mask=valid, other=0.0)[:, None]
    return x


@triton.jit
def _attend_tile(
    q,
    m_i,
    l_i,
    acc,
    tile_start,
    end,
    seq,
    kv_head,
    k_ptr,
    v_ptr,
    k_scale_ptr,
    v_scale_ptr,
    bt_ptr,
    cache_s_blk,
    cache_s_slot,
    cache_s_head,
    sc_s_blk,
    sc_s_slot,
    bt_s_b,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    """One online-softmax step over tokens [tile_start, tile_start + TILE_N) clipped to ``end``."""
    tokens = tile_start + tl.arange(0, TILE_N)
    valid = tokens < end
    dim = tl.arange(0, BLOCK_D)
    block = tl.load(bt_ptr + seq * bt_s_b + tokens // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    offset = tokens % BLOCK_SIZE
    rows = block * cache_s_blk + offset * cache_s_slot + kv_head * cache_s_head
    scale_rows = block * sc_s_blk + offset * sc_s_slot + kv_head
    k = _load_kv_tile(k_ptr, k_scale_ptr, rows, scale_rows, valid, dim, HEAD_DIM, QUANTIZED)
    scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_PAD, TILE_N], log2 units
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    v = _load_kv_tile(v_ptr, v_scale_ptr, rows, scale_rows, valid, dim, HEAD_DIM, QUANTIZED)
    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_scale_ptr,
    v_scale_ptr,
    bt_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale_log2,
    q_s_b,
    q_s_h,
    cache_s_blk,
    cache_s_slot,
    cache_s_head,
    sc_s_blk,
    sc_s_slot,
    bt_s_b,
    out_s_b,
    out_s_h,
    part_s_b,
    part_s_h,
    part_s_split,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE_N) * TILE_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    group = tl.arange(0, GROUP_PAD)
    dim = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + group
    io_mask = (group[:, None] < GROUP) & (dim[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + seq * q_s_b + heads[:, None] * q_s_h + dim[None, :], mask=io_mask, other=0.0)
    q = q.to(tl.float32) * qk_scale_log2

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    for tile_start in range(start, end, TILE_N):
        m_i, l_i, acc = _attend_tile(
            q,
            m_i,
            l_i,
            acc,
            tile_start,
            end,
            seq,
            kv_head,
            k_ptr,
            v_ptr,
            k_scale_ptr,
            v_scale_ptr,
            bt_ptr,
            cache_s_blk,
            cache_s_slot,
            cache_s_head,
            sc_s_blk,
            sc_s_slot,
            bt_s_b,
            BLOCK_SIZE,
            HEAD_DIM,
            BLOCK_D,
            TILE_N,
            QUANTIZED,
        )
    # An empty split (start >= end) has l_i == 0: it stores zeros and a log-sum-exp of -inf (weight 0).
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + seq * out_s_b + heads[:, None] * out_s_h + dim[None, :],
            _cast_rne(o, out_ptr.dtype.element_ty),
            mask=io_mask,
        )
    else:
        part = seq * part_s_b + heads * part_s_h + split * part_s_split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dim[None, :], o, mask=io_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=group < GROUP)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    part_s_b,
    part_s_h,
    part_s_split,
    out_s_b,
    out_s_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    split = tl.arange(0, SPLITS_PAD)
    dim = tl.arange(0, BLOCK_D)
    part = seq * part_s_b + head * part_s_h + split * part_s_split
    lse = tl.load(part_lse_ptr + part, mask=split < NUM_SPLITS, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, axis=0))  # split 0 is never empty, so the max is finite
    weights = weights / tl.sum(weights, axis=0)
    mask = (split[:, None] < NUM_SPLITS) & (dim[None, :] < HEAD_DIM)
    parts = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + dim[None, :], mask=mask, other=0.0)
    o = tl.sum(weights[:, None] * parts, axis=0)
    tl.store(
        out_ptr + seq * out_s_b + head * out_s_h + dim, _cast_rne(o, out_ptr.dtype.element_ty), mask=dim < HEAD_DIM
    )


def _tile_n(group_pad: int, block_d: int) -> int:
    if is_interpreted(_paged_decode_kernel):
        return 16  # small tiles so short test sequences still cross tile boundaries
    budget = max(1, MAX_TILE_ELEMENTS // (group_pad * block_d))
    return max(8, min(64, 1 << (budget.bit_length() - 1)))  # the largest power of two within the budget


def _num_warps(group_pad: int, tile_n: int, block_d: int) -> int:
    return 4 if group_pad * tile_n * block_d <= 4096 else 8


def _num_splits(batch: int, num_kv_heads: int, max_seq_len: int, tile_n: int, device: torch.device) -> int:
    """Split the sequence when (sequence, kv head) programs alone would leave SMs idle; 1 under the interpreter."""
    if is_interpreted(_paged_decode_kernel) or device.type != "cuda":
        return 1
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = triton.cdiv(2 * num_sms, batch * num_kv_heads)
    return max(1, min(wanted, triton.cdiv(max_seq_len, 4 * tile_n), MAX_SPLITS))


def _launch(q, pool, scales, layer, block_tables, seq_lens, sm_scale, max_seq_len, *, tile_n=None, num_splits=None):
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = pool.shape[3], pool.shape[4]
    group = num_q_heads // num_kv_heads
    group_pad, block_d = triton.next_power_of_2(group), triton.next_power_of_2(head_dim)
    tile_n = tile_n or _tile_n(group_pad, block_d)
    num_splits = num_splits or _num_splits(batch, num_kv_heads, max_seq_len, tile_n, q.device)
    quantized = pool.dtype in QUANT_DTYPES
    k_cache, v_cache = pool[:, layer, 0], pool[:, layer, 1]
    k_scales, v_scales = (scales[:, layer, 0], scales[:, layer, 1]) if quantized else (k_cache, v_cache)
    out = torch.empty_like(q)
    part_out = torch.empty((batch, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((batch, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        k_scales,
        v_scales,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        sm_scale * LOG2_E,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *(k_scales.stride()[:2] if quantized else (0, 0)),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        *part_lse.stride(),
        BLOCK_SIZE=block_size,
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        TILE_N=tile_n,
        NUM_SPLITS=num_splits,
        QUANTIZED=quantized,
        num_warps=_num_warps(group_pad, tile_n, block_d),
        enable_fp_fusion=True,
    )
    if num_splits > 1:
        _merge_splits_kernel[(batch, num_q_heads)](
            part_out,
            part_lse,
            out,
            *part_lse.stride(),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            enable_fp_fusion=True,
        )
    return out


def _check_attention_inputs(q, pool, layer, block_tables, seq_lens) -> int:
    """Validate shapes, dtypes, devices and index ranges; returns the longest sequence length."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a [batch, num_q_heads, head_dim] tensor, got {getattr(q, 'shape', q)}")
    if q.dtype not in ENGINE_DTYPES:
        raise ValueError(f"q dtype must be one of {ENGINE_DTYPES}, got {q.dtype}")
    num_blocks, num_layers, _, block_size, num_kv_heads, head_dim = pool.shape
    batch, num_q_heads = q.shape[:2]
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} != pool head_dim {head_dim}")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if not isinstance(layer, int) or not 0 <= layer < num_layers:
        raise ValueError(f"layer must be an int in [0, {num_layers}), got {layer!r}")
    check_index_tensor(block_tables, "block_tables", torch.int32, 2)
    check_index_tensor(seq_lens, "seq_lens", torch.int32, 1)
    check_same_device(pool, q=q, block_tables=block_tables, seq_lens=seq_lens)
    if block_tables.shape[0] != batch or seq_lens.shape[0] != batch:
        raise ValueError(
            f"batch mismatch: q {batch}, block_tables {block_tables.shape[0]}, seq_lens {seq_lens.shape[0]}"
        )
    if batch == 0:
        return 0
    max_pages = block_tables.shape[1]
    lo, hi = torch.stack([seq_lens.min(), seq_lens.max()]).tolist()
    if lo < 1 or hi > max_pages * block_size:
        raise ValueError(f"seq_lens must lie in [1, {max_pages * block_size}], got min {lo}, max {hi}")
    pages_used = (seq_lens.to(torch.int64) + block_size - 1) // block_size
    used = torch.arange(max_pages, device=pool.device)[None, :] < pages_used[:, None]
    blocks = block_tables[used]
    b_lo, b_hi = torch.stack([blocks.min(), blocks.max()]).tolist()
    if b_lo < 0 or b_hi >= num_blocks:
        raise ValueError(f"block_tables entries in use must lie in [0, {num_blocks}), got min {b_lo}, max {b_hi}")
    return hi


def paged_decode_attention(
    q: torch.Tensor,
    pool: torch.Tensor,
    scales: torch.Tensor | None,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sm_scale: float | None = None,
    impl: str | None = None,
) -> torch.Tensor:
    """Decode attention of q [B, Hq, D] over the first seq_lens[b] cached tokens of layer ``layer``.

    K/V are read in place from the pool (dequantized for int8/fp8); softmax in fp32; output [B, Hq, D] in
    q.dtype. sm_scale defaults to 1/sqrt(head_dim). Block table entries past a sequence's last page are ignored.
    """
    check_pool(pool, scales)
    max_seq_len = _check_attention_inputs(q, pool, layer, block_tables, seq_lens)
    sm_scale = 1.0 / math.sqrt(q.shape[2]) if sm_scale is None else float(sm_scale)
    if q.shape[0] == 0:
        return torch.empty_like(q)
    if resolve_impl(impl, pool.device, _paged_decode_kernel) == "reference":
        return paged_decode_attention_reference(q, pool, scales, layer, block_tables, seq_lens, sm_scale)
    q = q if q.stride(2) == 1 else q.contiguous()
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
    return _launch(q, pool, scales, layer, block_tables, seq_lens, sm_scale, max_seq_len)
