"""write_kv: scatter engine KV of new tokens into paged pool slots, quantizing for int8/fp8 pools.

Layout (explicit strides; the head_dim stride of the pool and the head stride of the scales are 1):
  kv     [num_layers, 2, num_tokens, num_kv_heads, head_dim]   engine dtype, any strides
  pool   [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
  scales [num_blocks, num_layers, 2, block_size, num_kv_heads]  fp32, int8/fp8 pools only
  slot   = block * block_size + offset; -1 skips the token.
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
from kcaas_kernels._triton_math import _cast_rne, _quantize_rows
from kcaas_kernels.reference import write_kv_reference


@triton.jit
def _write_layer(
    kv_ptr,
    pool_ptr,
    scales_ptr,
    layer,
    token,
    block,
    offset,
    heads_here,
    kv_s_layer,
    kv_s_kv,
    kv_s_tok,
    kv_s_head,
    kv_s_dim,
    pool_s_blk,
    pool_s_layer,
    pool_s_kv,
    pool_s_slot,
    pool_s_head,
    sc_s_blk,
    sc_s_layer,
    sc_s_kv,
    sc_s_slot,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    kvi = tl.arange(0, 2)[:, None, None]
    head = tl.arange(0, BLOCK_H)[None, :, None]
    dim = tl.arange(0, BLOCK_D)[None, None, :]
    mask = (head < heads_here) & (dim < HEAD_DIM)
    src = kv_ptr + layer * kv_s_layer + kvi * kv_s_kv + token * kv_s_tok + head * kv_s_head + dim * kv_s_dim
    x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    dst = pool_ptr + block * pool_s_blk + layer * pool_s_layer + kvi * pool_s_kv + offset * pool_s_slot
    dst = dst + head * pool_s_head + dim
    if QUANTIZED:
        q, scale = _quantize_rows(x, pool_ptr.dtype.element_ty, 2)
        tl.store(dst, q, mask=mask)
        kvi2 = tl.arange(0, 2)[:, None]
        head2 = tl.arange(0, BLOCK_H)[None, :]
        sc = scales_ptr + block * sc_s_blk + layer * sc_s_layer + kvi2 * sc_s_kv + offset * sc_s_slot + head2
        tl.store(sc, scale, mask=head2 < heads_here)
    else:
        tl.store(dst, _cast_rne(x, pool_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(
    kv_ptr,
    pool_ptr,
    scales_ptr,
    slot_ptr,
    num_layers,
    kv_s_layer,
    kv_s_kv,
    kv_s_tok,
    kv_s_head,
    kv_s_dim,
    pool_s_blk,
    pool_s_layer,
    pool_s_kv,
    pool_s_slot,
    pool_s_head,
    sc_s_blk,
    sc_s_layer,
    sc_s_kv,
    sc_s_slot,
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
    # A skipped token (slot -1) gets an empty head range: every load and store is masked off. (Combining the
    # scalar flag with a tile mask by `&` yields an int mask in the interpreter, which tl.load rejects.)
    heads_here = tl.where(slot >= 0, NUM_HEADS, 0)
    block = tl.maximum(slot, 0) // BLOCK_SIZE
    offset = tl.maximum(slot, 0) % BLOCK_SIZE
    for layer in range(first_layer, tl.minimum(first_layer + LAYERS_PER_PROGRAM, num_layers)):
        _write_layer(
            kv_ptr,
            pool_ptr,
            scales_ptr,
            layer,
            token,
            block,
            offset,
            heads_here,
            kv_s_layer,
            kv_s_kv,
            kv_s_tok,
            kv_s_head,
            kv_s_dim,
            pool_s_blk,
            pool_s_layer,
            pool_s_kv,
            pool_s_slot,
            pool_s_head,
            sc_s_blk,
            sc_s_layer,
            sc_s_kv,
            sc_s_slot,
            NUM_HEADS,
            HEAD_DIM,
            BLOCK_H,
            BLOCK_D,
            QUANTIZED,
        )


def _launch(kv: torch.Tensor, pool: torch.Tensor, scales: torch.Tensor | None, slot_mapping: torch.Tensor) -> None:
    num_layers, _, num_tokens, num_heads, head_dim = kv.shape
    quantized = pool.dtype in QUANT_DTYPES
    scale_strides: tuple[int, ...] = (0, 0, 0, 0)
    if quantized:
        assert scales is not None, "a quantized pool has scales"
        scale_strides = scales.stride()[:4]
    per_program = layers_per_program(num_layers, 2 * num_heads * head_dim * kv.element_size(), _write_kv_kernel)
    grid = (num_tokens, triton.cdiv(num_layers, per_program))
    _write_kv_kernel[grid](
        kv,
        pool,
        scales if quantized else pool,
        slot_mapping,
        num_layers,
        *kv.stride(),
        *pool.stride()[:5],
        *scale_strides,
        BLOCK_SIZE=pool.shape[3],
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        LAYERS_PER_PROGRAM=per_program,
        QUANTIZED=quantized,
        enable_fp_fusion=False,  # no mul+add contraction: bit-equality with the reference
    )


def check_engine_kv(kv: torch.Tensor, pool: torch.Tensor) -> None:
    """kv must be [num_layers, 2, num_tokens, num_kv_heads, head_dim] in an engine dtype, matching the pool."""
    if not isinstance(kv, torch.Tensor):
        raise ValueError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    num_layers, num_heads, head_dim = pool.shape[1], pool.shape[4], pool.shape[5]
    expected = (num_layers, 2, num_heads, head_dim)
    if kv.dim() != 5 or (kv.shape[0], kv.shape[1], kv.shape[3], kv.shape[4]) != expected:
        raise ValueError(
            f"kv must have shape [num_layers={num_layers}, 2, num_tokens, num_kv_heads={num_heads}, "
            f"head_dim={head_dim}], got {tuple(kv.shape)}"
        )
    if kv.dtype not in ENGINE_DTYPES:
        raise ValueError(f"kv dtype must be one of {ENGINE_DTYPES}, got {kv.dtype}")


def write_kv(
    kv: torch.Tensor,
    pool: torch.Tensor,
    scales: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    *,
    impl: str | None = None,
) -> None:
    """pool[slot_mapping[t]] = kv[:, :, t] for every token t whose slot is not -1.

    Quantizes (scheme in kcaas_kernels/quant.py) when the pool is int8/fp8; ``scales`` is required then and must be
    None otherwise. Valid slots must be distinct (which of two writes to one slot wins is unspecified).
    Storing is not differentiable: a ``kv`` that requires grad is read as ``kv.detach()`` (the same values), so the
    pool never joins an autograd graph. For int8/fp8 pools the values must be finite with |x| <= QUANT_MAX_ABS_INPUT
    (not checked here: the engine refuses other KV first, gpu_node/engine/kv_input.py).
    """
    check_pool(pool, scales)
    check_engine_kv(kv, pool)
    kv = kv.detach()
    check_same_device(pool, kv=kv)
    check_slot_mapping(slot_mapping, kv.shape[2], pool.shape[0] * pool.shape[3])
    check_same_device(pool, slot_mapping=slot_mapping)
    if kv.shape[2] == 0:
        return
    if resolve_impl(impl, pool.device, _write_kv_kernel) == "reference":
        write_kv_reference(kv, pool, scales, slot_mapping)
    else:
        _launch(kv, pool, scales, slot_mapping.contiguous())
