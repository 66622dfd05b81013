"""Builders shared by the kernel tests: garbage-filled pools, shuffled block tables, naive per-token oracles."""

import os

import pytest
import torch

from kernels import QUANT_DTYPES, quantize

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
