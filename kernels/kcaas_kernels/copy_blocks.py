"""copy_blocks: dst[dst_ids[i]] = src[src_ids[i]] for whole blocks (and their scales).

Used for copy-on-write (src and dst are the same pool) and tiering / migration (two pools of the same block
shape and dtype, possibly on different devices). Bytes are copied verbatim: the pools are viewed as rows of
block_numel integer elements of the same width, so every storage dtype (fp8 included) moves bit for bit.
Layout: pool [num_blocks, block_numel] (contiguous, block-major), ids int64 [num_pairs].
Grid: (num_pairs, cdiv(block_numel, CHUNK)); a program copies CHUNK elements of one block.
Triton runs only when both pools are on the same CUDA device (or on CPU under the interpreter); otherwise torch.
"""

import torch

from kcaas_kernels._common import IMPLS, check_block_ids, check_pool, is_interpreted, resolve_impl, tl, triton
from kcaas_kernels.reference import copy_blocks_reference

CUDA_CHUNK = 4096
INTERPRETER_MAX_CHUNK = 1 << 16
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _copy_blocks_kernel(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, block_numel, CHUNK: tl.constexpr):
    pair = tl.program_id(0)
    offsets = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    mask = offsets < block_numel
    src_block = tl.load(src_ids_ptr + pair)
    dst_block = tl.load(dst_ids_ptr + pair)
    values = tl.load(src_ptr + src_block * block_numel + offsets, mask=mask)
    tl.store(dst_ptr + dst_block * block_numel + offsets, values, mask=mask)


def _as_int_rows(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_OF_WIDTH[t.element_size()]).view(t.shape[0], -1)


def _launch_one(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    src_rows, dst_rows = _as_int_rows(src), _as_int_rows(dst)
    block_numel = src_rows.shape[1]
    if is_interpreted(_copy_blocks_kernel):
        chunk = min(triton.next_power_of_2(block_numel), INTERPRETER_MAX_CHUNK)
    else:
        chunk = min(triton.next_power_of_2(block_numel), CUDA_CHUNK)
    grid = (src_ids.shape[0], triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](src_rows, dst_rows, src_ids, dst_ids, block_numel, CHUNK=chunk, enable_fp_fusion=False)


def _launch(src_pool, src_scales, dst_pool, dst_scales, src_ids, dst_ids) -> None:
    _launch_one(src_pool, dst_pool, src_ids, dst_ids)
    if src_scales is not None:
        _launch_one(src_scales, dst_scales, src_ids, dst_ids)


def _as_ids(ids, name: str) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        ids = torch.as_tensor(list(ids), dtype=torch.int64)
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{name} must be a 1-D int32/int64 tensor or a sequence of ints, got {ids.dtype} {ids.dim()}-D"
        )
    return ids.to(torch.int64)


def _check_ids(src_pool, dst_pool, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    if src_ids.shape != dst_ids.shape:
        raise ValueError(f"src_ids and dst_ids differ in length: {src_ids.shape[0]} vs {dst_ids.shape[0]}")
    check_block_ids(src_ids, "src_ids", src_pool.shape[0])
    check_block_ids(dst_ids, "dst_ids", dst_pool.shape[0])
    if torch.unique(dst_ids).numel() != dst_ids.numel():
        raise ValueError("dst_ids must be distinct (two copies into one block)")
    same_storage = src_pool.data_ptr() == dst_pool.data_ptr() and src_pool.device == dst_pool.device
    if same_storage and bool(torch.isin(dst_ids, src_ids.to(dst_ids.device)).any()):
        raise ValueError("within one pool, a block may not be both a source and a destination of one call")


def copy_blocks(
    src_pool: torch.Tensor,
    src_scales: torch.Tensor | None,
    dst_pool: torch.Tensor,
    dst_scales: torch.Tensor | None,
    src_ids,
    dst_ids,
    *,
    impl: str | None = None,
) -> None:
    """dst_pool[dst_ids[i]] = src_pool[src_ids[i]] (and the scales), for whole blocks.

    ``src_ids``/``dst_ids``: 1-D integer tensors (any device) or sequences of ints. dst ids must be distinct;
    within one pool no block may be both a source and a destination. The pools must share block shape and dtype.
    """
    check_pool(src_pool, src_scales, "src_pool")
    check_pool(dst_pool, dst_scales, "dst_pool")
    if src_pool.shape[1:] != dst_pool.shape[1:] or src_pool.dtype != dst_pool.dtype:
        raise ValueError(
            f"pools differ in block shape or dtype: src {src_pool.dtype} {tuple(src_pool.shape[1:])}, "
            f"dst {dst_pool.dtype} {tuple(dst_pool.shape[1:])}"
        )
    src_ids, dst_ids = _as_ids(src_ids, "src_ids"), _as_ids(dst_ids, "dst_ids")
    _check_ids(src_pool, dst_pool, src_ids, dst_ids)
    if src_ids.numel() == 0:
        return
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} or None, got {impl!r}")
    if src_pool.device == dst_pool.device and resolve_impl(impl, dst_pool.device, _copy_blocks_kernel) == "triton":
        device = dst_pool.device
        src_ids, dst_ids = src_ids.to(device).contiguous(), dst_ids.to(device).contiguous()
        _launch(src_pool, src_scales, dst_pool, dst_scales, src_ids, dst_ids)
    else:  # includes every cross-device copy, whatever impl says
        copy_blocks_reference(src_pool, src_scales, dst_pool, dst_scales, src_ids, dst_ids)
