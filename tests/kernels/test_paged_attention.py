"""paged_decode_attention: Triton vs reference, reference vs torch SDPA on gathered K/V.

Pools are filled with NaN (int8: 127/-128 garbage with NaN scales) and block tables are shuffled with -1 past
each sequence's pages, so any read beyond a sequence turns the output NaN.

NOTE on tolerances. Triton and the reference both compute in fp32 but in a different order (online softmax over
16-token tiles with exp2 of pre-scaled scores vs one softmax with exp), so fp32 outputs differ by a few ulps of
the O(1) values: atol/rtol 1e-5 leaves ~100x headroom over the ~2e-7 observed, and stays far below any indexing
error (those are O(1) or NaN). fp16/bf16 outputs are the fp32 results rounded once, so two fp32 values a few ulps
apart can round to neighbouring half-precision values: one output ulp (2**-10 fp16, 2**-7 bf16, relative).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from kcaas_kernels import paged_decode_attention, read_kv, write_kv
from kcaas_kernels.paged_attention import _launch
from tests.kernels.helpers import STORAGE, TRITON_DEVICES, make_pool, shuffled_block_tables, slots_of

TOLERANCE = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-5, rtol=2**-10),
    torch.bfloat16: dict(atol=1e-5, rtol=2**-7),
}

# (block_size, seq_lens, num_q_heads, num_kv_heads, head_dim, q dtype)
CASES = [
    pytest.param(16, [1, 17, 33], 4, 2, 16, torch.float32, id="bs16-GQA4/2-D16-fp32"),
    pytest.param(1, [5, 1, 17], 6, 2, 8, torch.bfloat16, id="bs1-GQA6/2-D8-bf16"),
    pytest.param(16, [33, 20], 2, 2, 64, torch.float16, id="bs16-MHA2-D64-fp16"),
]
NUM_LAYERS, LAYER = 2, 1


def _scenario(storage, block_size, seq_lens, num_q_heads, num_kv_heads, head_dim, q_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
    pool, scales = make_pool(num_blocks, NUM_LAYERS, block_size, num_kv_heads, head_dim, storage, "cpu")
    table = shuffled_block_tables(seq_lens, block_size, num_blocks, gen, max_blocks=max(seq_lens) // block_size + 2)
    for b, n in enumerate(seq_lens):
        kv = torch.randn((NUM_LAYERS, 2, n, num_kv_heads, head_dim), generator=gen)
        kv_dtype = q_dtype if storage not in (torch.int8, torch.float8_e4m3fn) else torch.float32
        write_kv(kv.to(kv_dtype), pool, scales, slots_of(table[b], n, block_size), impl="reference")
    q = torch.randn((len(seq_lens), num_q_heads, head_dim), generator=gen).to(q_dtype)
    return q, pool, scales, table, torch.tensor(seq_lens, dtype=torch.int32)


def _to(device, *tensors):
    return [t.to(device) if t is not None else None for t in tensors]


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("storage", STORAGE, ids=str)
@pytest.mark.parametrize("block_size,seq_lens,num_q_heads,num_kv_heads,head_dim,q_dtype", CASES)
def test_triton_matches_reference(device, storage, block_size, seq_lens, num_q_heads, num_kv_heads, head_dim, q_dtype):
    q, pool, scales, table, lens = _to(
        device, *_scenario(storage, block_size, seq_lens, num_q_heads, num_kv_heads, head_dim, q_dtype)
    )
    ref = paged_decode_attention(q, pool, scales, LAYER, table, lens, impl="reference")
    tri = paged_decode_attention(q, pool, scales, LAYER, table, lens, impl="triton")
    assert tri.dtype == q_dtype and tri.shape == q.shape
    assert not ref.isnan().any() and not tri.isnan().any(), "read beyond a sequence"
    torch.testing.assert_close(tri, ref, **TOLERANCE[q_dtype])


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("storage", [torch.float32, torch.int8], ids=str)
def test_split_kv_matches_reference(device, storage):
    """Flash-decoding splits (3 per sequence, empty ones included) merge to the single-pass result."""
    q, pool, scales, table, lens = _to(device, *_scenario(storage, 16, [1, 17, 33, 50], 8, 2, 16, torch.float32))
    ref = paged_decode_attention(q, pool, scales, LAYER, table, lens, sm_scale=0.3, impl="reference")
    tri = _launch(q, pool, scales, LAYER, table, lens, 0.3, max_seq_len=50, tile_n=16, num_splits=3)
    torch.testing.assert_close(tri, ref, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("storage", STORAGE, ids=str)
@pytest.mark.parametrize("block_size,seq_lens,num_q_heads,num_kv_heads,head_dim,q_dtype", CASES)
def test_reference_matches_sdpa(storage, block_size, seq_lens, num_q_heads, num_kv_heads, head_dim, q_dtype):
    """The reference against torch SDPA on K/V gathered (and dequantized) into contiguous tensors."""
    q, pool, scales, table, lens = _scenario(
        storage, block_size, seq_lens, num_q_heads, num_kv_heads, head_dim, q_dtype
    )
    got = paged_decode_attention(q, pool, scales, LAYER, table, lens, impl="reference")
    group = num_q_heads // num_kv_heads
    for b, n in enumerate(seq_lens):
        kv = read_kv(pool, scales, slots_of(table[b], n, block_size), out_dtype=torch.float32)[LAYER]
        k, v = (t.transpose(0, 1).repeat_interleave(group, dim=0)[None] for t in kv)  # [1, Hq, n, D]
        expected = F.scaled_dot_product_attention(q[b].float()[None, :, None, :], k, v)[0, :, 0]
        torch.testing.assert_close(got[b], expected.to(q_dtype), **TOLERANCE[q_dtype])


def test_sm_scale_default_is_inverse_sqrt_head_dim():
    q, pool, scales, table, lens = _scenario(torch.float32, 16, [17], 2, 1, 16, torch.float32)
    default = paged_decode_attention(q, pool, scales, LAYER, table, lens)
    explicit = paged_decode_attention(q, pool, scales, LAYER, table, lens, sm_scale=1 / math.sqrt(16))
    assert torch.equal(default, explicit)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("storage", [torch.float16, torch.int8], ids=str)
def test_long_sequence(device, storage):
    """1025 cached tokens (65 tiles, the last holding one token) next to a 3-token sequence; GQA 4:1."""
    q, pool, scales, table, lens = _to(device, *_scenario(storage, 16, [1025, 3], 4, 1, 16, torch.float16))
    ref = paged_decode_attention(q, pool, scales, LAYER, table, lens, impl="reference")
    tri = paged_decode_attention(q, pool, scales, LAYER, table, lens, impl="triton")
    assert not tri.isnan().any()
    torch.testing.assert_close(tri, ref, **TOLERANCE[torch.float16])
