"""Builders shared by the kernel tests: garbage-filled pools, shuffled block tables, naive per-token oracles."""

import math
import os

import pytest
import torch

from kcaas_kernels import QUANT_DTYPES, quantize

INTERPRETER_ON = os.environ.get("TRITON_INTERPRET") == "1"

# The Triton path on CPU needs the interpreter; on CUDA it is the real thing. Same tests, both devices.
TRITON_DEVICES = [
    pytest.param(
        "cpu", marks=pytest.mark.skipif(not INTERPRETER_ON, reason="TRITON_INTERPRET=1 not set: no Triton on CPU")
    ),
    pytest.param(
        "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
    ),
]

STORAGE = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.float8_e4m3fn]


_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers, so torch.equal compares bit for bit (NaN garbage included; fp8 too)."""
    return t.view(_INT_OF_WIDTH[t.element_size()])


def make_pool(num_blocks, num_layers, block_size, num_heads, head_dim, dtype, device, seed=0):
    """A pool whose every slot holds garbage that shows if read: NaN for floats (NaN bytes for fp8),
    random 127/-128 for int8 with NaN scales."""
    shape = (num_blocks, num_layers, 2, block_size, num_heads, head_dim)
    if dtype == torch.int8:
        gen = torch.Generator().manual_seed(seed)
        pool = torch.where(torch.rand(shape, generator=gen) < 0.5, 127, -128).to(torch.int8)
    elif dtype == torch.float8_e4m3fn:
        pool = torch.full(shape, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)
    else:
        pool = torch.full(shape, float("nan"), dtype=dtype)
    scales = torch.full(shape[:5], float("nan")) if dtype in QUANT_DTYPES else None
    return pool.to(device), (scales.to(device) if scales is not None else None)


def shuffled_block_tables(seq_lens, block_size, num_blocks, gen, max_blocks=None):
    """Distinct, shuffled blocks per sequence; unused table entries are -1 (never to be read)."""
    pages = [-(-n // block_size) for n in seq_lens]
    max_blocks = max_blocks or max(pages)
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    used = 0
    for b, n_pages in enumerate(pages):
        table[b, :n_pages] = perm[used : used + n_pages].to(torch.int32)
        used += n_pages
    assert used <= num_blocks, "test pool too small"
    return table


def slots_of(block_table_row, seq_len, block_size, start=0):
    tokens = torch.arange(start, seq_len)
    return block_table_row[tokens // block_size].to(torch.int64) * block_size + tokens % block_size


def naive_write(kv, pool, scales, slot_mapping):
    """Per-token, per-layer loop: the independent oracle for write_kv."""
    num_layers = kv.shape[0]
    block_size = pool.shape[3]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        for layer in range(num_layers):
            for k_or_v in range(2):
                row = kv[layer, k_or_v, token]
                if scales is None:
                    pool[block, layer, k_or_v, offset] = row.to(pool.dtype)
                else:
                    q, s = quantize(row, pool.dtype)
                    pool[block, layer, k_or_v, offset] = q
                    scales[block, layer, k_or_v, offset] = s


def naive_read(pool, scales, slot_mapping, out_dtype):
    """Per-token loop: the independent oracle for read_kv (zeros for slot -1)."""
    _, num_layers, _, block_size, num_heads, head_dim = pool.shape
    out = torch.zeros((num_layers, 2, slot_mapping.shape[0], num_heads, head_dim), dtype=out_dtype)
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        rows = pool[block, :, :, offset].float()
        if scales is not None:
            rows = rows * scales[block, :, :, offset].unsqueeze(-1)
        out[:, :, token] = rows.to(out_dtype)
    return out


def _fit(values, head_dim: int) -> torch.Tensor:
    """``values`` (float64) repeated or cut to head_dim elements."""
    values = torch.as_tensor(values, dtype=torch.float64).flatten()
    return values.repeat(-(-head_dim // values.numel()))[:head_dim]


def adversarial_rows(dtype: torch.dtype, head_dim: int, seed: int = 0) -> torch.Tensor:
    """Rows [R, head_dim] of ``dtype`` at the quantizer's edges: zeros, the dtype's smallest subnormal alone,
    all-subnormal rows, amax at the smallest normal, amax at the scale floor's boundaries (127 and 448 times
    2**-126), mixed magnitudes from the dtype's top down to its subnormals, amax at the top (fp16: 65504; fp32 and
    bf16: the bf16 maximum, the largest value int8/fp8 storage takes), a negative amax, exact int8 and e4m3 ties,
    e4m3-subnormal quotients, random and heavy-tailed rows. Every value is finite and representable in ``dtype``."""
    info = torch.finfo(dtype)
    tiny, sub = info.tiny, info.tiny * info.eps  # smallest normal, smallest subnormal
    top = min(info.max, torch.finfo(torch.bfloat16).max)
    gen = torch.Generator().manual_seed(seed)

    def randn():
        return torch.randn(head_dim, generator=gen, dtype=torch.float64)

    def with_amax(amax, row=None):
        row = randn() if row is None else row
        row = row / row.abs().max() * amax
        row[0] = amax
        return row

    log_top, log_sub = math.log2(top), math.log2(sub)
    mixed = torch.exp2(log_top + torch.linspace(0, 1, head_dim, dtype=torch.float64) * (log_sub - log_top))
    signs = torch.where(torch.arange(head_dim) % 2 == 0, 1.0, -1.0).to(torch.float64)
    rows = [
        torch.zeros(head_dim, dtype=torch.float64),
        _fit([sub] + [0.0] * (head_dim - 1), head_dim),
        _fit([-sub, sub, 3 * sub, 0.0], head_dim),
        randn() * tiny / 4,  # all subnormal (rounded onto the subnormal grid)
        with_amax(tiny, randn() * tiny / 8),
        with_amax(127 * 2.0**-126),
        with_amax(448 * 2.0**-126),
        with_amax(100 * 2.0**-126),
        mixed * signs,  # top ... 1 ... smallest subnormal in one row
        with_amax(top),
        -with_amax(top),  # amax from a negative element
        with_amax(top, torch.full((head_dim,), top / 3, dtype=torch.float64)),
        _fit([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 126.5, -125.5], head_dim),  # int8 ties at scale 1
        _fit([448.0, 1.0625, 1.1875, -1.3125, 3 * 2.0**-10, -5 * 2.0**-10, 2.0**-9, 2.0**-7], head_dim),  # e4m3 ties
        with_amax(448.0, randn() * 2.0**-7),  # e4m3-subnormal quotients
        _fit([-3.0] + [0.0] * (head_dim - 1), head_dim),
        randn() * 4,
        randn() ** 3 * 100,
    ]
    return torch.stack(rows).to(dtype)
