"""read_kv: gather KV of tokens out of paged pool slots into engine layout, dequantizing int8/fp8 pools.

Layout (explicit strides; the head_dim stride of the pool and the head stride of the scales are 1):
  pool   [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
  scales [num_blocks, num_layers, 2, block_size, num_kv_heads]  fp32, int8/fp8 pools only
  out    [num_layers, 2, num_tokens, num_kv_heads, head_dim]   out_dtype, contiguous: allocated, or the caller's out=
  slot   = block * block_size + offset; -1 yields zeros.
Grid: (num_tokens, cdiv(num_layers, LAYERS_PER_PROGRAM)); a program moves one token's [2, H, D] tile per layer.
"""

import torch

from kcaas_kernels._common import (
    ENGINE_DTYPES,
    QUANT_DTYPES,
    check_pool,
    check_same_device,
    check_slot_mapping,
    layers_per_program,
    resolve_impl,
    tl,
    triton,
)
from kcaas_kernels._triton_math import _cast_rne
from kcaas_kernels.reference import read_kv_reference


@triton.jit
def _read_layer(
    pool_ptr,
    scales_ptr,
    out_ptr,
    layer,
    token,
    block,
    offset,
    heads_here,
    pool_s_blk,
    pool_s_layer,
    pool_s_kv,
    pool_s_slot,
    pool_s_head,
    sc_s_blk,
    sc_s_layer,
    sc_s_kv,
    sc_s_slot,
    out_s_layer,
    out_s_kv,
    out_s_tok,
    out_s_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    kvi = tl.arange(0, 2)[:, None, None]
    head = tl.arange(0, BLOCK_H)[None, :, None]
    dim = tl.arange(0, BLOCK_D)[None, None, :]
    src = pool_ptr + block * pool_s_blk + layer * pool_s_layer + kvi * pool_s_kv + offset * pool_s_slot
    src = src + head * pool_s_head + dim
    x = tl.load(src, mask=(head < heads_here) & (dim < HEAD_DIM), other=0.0).to(tl.float32)
    if QUANTIZED:
        sc = scales_ptr + block * sc_s_blk + layer * sc_s_layer + kvi * sc_s_kv + offset * sc_s_slot + head
        x = x * tl.load(sc, mask=head < heads_here, other=0.0)
    dst = out_ptr + layer * out_s_layer + kvi * out_s_kv + token * out_s_tok + head * out_s_head + dim
    tl.store(dst, _cast_rne(x, out_ptr.dtype.element_ty), mask=(head < NUM_HEADS) & (dim < HEAD_DIM))


@triton.jit
def _read_kv_kernel(
    pool_ptr,
    scales_ptr,
    slot_ptr,
    out_ptr,
    num_layers,
    pool_s_blk,
    pool_s_layer,
    pool_s_kv,
    pool_s_slot,
    pool_s_head,
    sc_s_blk,
    sc_s_layer,
    sc_s_kv,
    sc_s_slot,
    out_s_layer,
    out_s_kv,
    out_s_tok,
    out_s_head,
    BLOCK_SIZE: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    LAYERS_PER_PROGRAM: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    first_layer = tl.program_id(1) * LAYERS_PER_PROGRAM
    slot = tl.load(slot_ptr + token)
    # A slot of -1 loads nothing (empty head range, masked loads give 0) and stores zeros.
    heads_here = tl.where(slot >= 0, NUM_HEADS, 0)
    block = tl.maximum(slot, 0) // BLOCK_SIZE
    offset = tl.maximum(slot, 0) % BLOCK_SIZE
    for layer in range(first_layer, tl.minimum(first_layer + LAYERS_PER_PROGRAM, num_layers)):
        _read_layer(
            pool_ptr,
            scales_ptr,
            out_ptr,
            layer,
            token,
            block,
            offset,
            heads_here,
            pool_s_blk,
            pool_s_layer,
            pool_s_kv,
            pool_s_slot,
            pool_s_head,
            sc_s_blk,
            sc_s_layer,
            sc_s_kv,
            sc_s_slot,
            out_s_layer,
            out_s_kv,
            out_s_tok,
            out_s_head,
            NUM_HEADS,
            HEAD_DIM,
            BLOCK_H,
            BLOCK_D,
            QUANTIZED,
        )


def _launch(pool: torch.Tensor, scales: torch.Tensor | None, slot_mapping: torch.Tensor, out: torch.Tensor) -> None:
    num_layers, _, num_tokens, num_heads, head_dim = out.shape
    quantized = pool.dtype in QUANT_DTYPES
    scale_strides: tuple[int, ...] = (0, 0, 0, 0)
    if quantized:
        assert scales is not None, "a quantized pool has scales"
        scale_strides = scales.stride()[:4]
    per_program = layers_per_program(num_layers, 2 * num_heads * head_dim * out.element_size(), _read_kv_kernel)
    grid = (num_tokens, triton.cdiv(num_layers, per_program))
    _read_kv_kernel[grid](
        pool,
        scales if quantized else pool,
        slot_mapping,
        out,
        num_layers,
        *pool.stride()[:5],
        *scale_strides,
        *out.stride()[:4],
        BLOCK_SIZE=pool.shape[3],
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        LAYERS_PER_PROGRAM=per_program,
        QUANTIZED=quantized,
        enable_fp_fusion=False,  # no mul+add contraction: bit-equality with the reference
    )


def _check_out(out: torch.Tensor, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != dtype:
        raise ValueError(
            f"out must be a {dtype} tensor of shape {shape}, got {getattr(out, 'dtype', out)} "
            f"{tuple(getattr(out, 'shape', ()))}"
        )
    if out.device != device or not out.is_contiguous():
        raise ValueError(f"out must be contiguous and on {device}")


def read_kv(
    pool: torch.Tensor,
    scales: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    impl: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return kv [num_layers, 2, num_tokens, H, D] of out_dtype with kv[:, :, t] = pool[slot_mapping[t]].

    Dequantizes int8/fp8 pools; a slot of -1 produces zeros for that token. ``out`` (optional): a contiguous
    destination of that shape and dtype on the pool's device (e.g. a reused or pinned staging buffer); it is
    filled and returned instead of a freshly allocated tensor.
    """
    check_pool(pool, scales)
    if out_dtype not in ENGINE_DTYPES:
        raise ValueError(f"out_dtype must be one of {ENGINE_DTYPES}, got {out_dtype}")
    check_slot_mapping(slot_mapping, None, pool.shape[0] * pool.shape[3])
    check_same_device(pool, slot_mapping=slot_mapping)
    _, num_layers, _, _, num_heads, head_dim = pool.shape
    shape = (num_layers, 2, slot_mapping.shape[0], num_heads, head_dim)
    if out is None:
        out = torch.empty(shape, dtype=out_dtype, device=pool.device)
    else:
        _check_out(out, shape, out_dtype, pool.device)
    if resolve_impl(impl, pool.device, _read_kv_kernel) == "reference":
        return read_kv_reference(pool, scales, slot_mapping, out_dtype, out)
    if slot_mapping.shape[0] > 0:
        _launch(pool, scales, slot_mapping.contiguous(), out)
    return out
