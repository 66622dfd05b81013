"""write_kv / read_kv: Triton vs reference (bit-exact), reference vs naive per-token loops, round trips.

NOTE on tolerances: none. Both implementations compute the same fp32 formulas with correctly rounded
division (tl.math.div_rn / torch tensor division), the same round-half-to-even (torch.round / the fp32
1.5*2**23 trick) and round-to-nearest-even casts (the Triton kernels round in fp32 before casting so the cast
is exact), so q, scales and dequantized outputs must agree bit for bit.
"""

import pytest
import torch

from kcaas_kernels import QUANT_DTYPES, error_bound, read_kv, reference, write_kv
from tests.kernels.helpers import (
    STORAGE,
    TRITON_DEVICES,
    bits,
    make_pool,
    naive_read,
    naive_write,
    shuffled_block_tables,
    slots_of,
)

# (block_size, seq_lens, num_layers, num_kv_heads, head_dim, kv dtype): odd lengths, page sizes 1 and 16.
CASES = [
    pytest.param(16, [33, 1, 17], 2, 2, 16, torch.float32, id="bs16-len33,1,17-H2-D16-fp32"),
    pytest.param(1, [17], 2, 3, 8, torch.bfloat16, id="bs1-len17-H3-D8-bf16"),
]


def _scenario(block_size, seq_lens, num_layers, num_heads, head_dim, kv_dtype, seed=0):
    """KV for all tokens of all sequences plus their (shuffled) slots, with two tokens marked -1."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    table = shuffled_block_tables(seq_lens, block_size, num_blocks, gen)
    slots = torch.cat([slots_of(table[b], n, block_size) for b, n in enumerate(seq_lens)])
    slots[torch.randperm(slots.shape[0], generator=gen)[:2]] = -1
    kv = torch.randn((num_layers, 2, slots.shape[0], num_heads, head_dim), generator=gen) * 4
    kv[0, 1, 3] = 0.0  # an all-zero row: scale 1.0 when quantized
    return num_blocks, kv.to(kv_dtype), slots


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("storage", STORAGE, ids=str)
@pytest.mark.parametrize("block_size,seq_lens,num_layers,num_heads,head_dim,kv_dtype", CASES)
def test_write_kv_triton_matches_reference(
    device, storage, block_size, seq_lens, num_layers, num_heads, head_dim, kv_dtype
):
    num_blocks, kv, slots = _scenario(block_size, seq_lens, num_layers, num_heads, head_dim, kv_dtype)
    kv, slots = kv.to(device), slots.to(device)
    results = []
    for impl in ("reference", "triton"):
        pool, scales = make_pool(num_blocks, num_layers, block_size, num_heads, head_dim, storage, device)
        write_kv(kv, pool, scales, slots, impl=impl)
        results.append((pool, scales))
    (ref_pool, ref_scales), (tri_pool, tri_scales) = results
    # Whole pools, bit for bit: written slots agree and every other slot still holds its garbage.
    assert torch.equal(bits(tri_pool), bits(ref_pool))
    if storage in QUANT_DTYPES:
        assert torch.equal(bits(tri_scales), bits(ref_scales))


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("storage", STORAGE, ids=str)
@pytest.mark.parametrize("block_size,seq_lens,num_layers,num_heads,head_dim,kv_dtype", CASES)
def test_read_kv_triton_matches_reference(
    device, storage, block_size, seq_lens, num_layers, num_heads, head_dim, kv_dtype
):
    num_blocks, kv, slots = _scenario(block_size, seq_lens, num_layers, num_heads, head_dim, kv_dtype)
    pool, scales = make_pool(num_blocks, num_layers, block_size, num_heads, head_dim, storage, "cpu")
    write_kv(kv, pool, scales, slots, impl="reference")
    pool, slots = pool.to(device), slots.to(device)
    scales = scales.to(device) if scales is not None else None
    for out_dtype in (kv_dtype, torch.float16):
        ref = read_kv(pool, scales, slots, out_dtype=out_dtype, impl="reference")
        out = torch.full(ref.shape, 5.0, dtype=out_dtype, device=device)  # a reused buffer holding old data
        tri = read_kv(pool, scales, slots, out_dtype=out_dtype, impl="triton", out=out)
        assert tri is out
        assert tri.dtype == out_dtype and tri.shape == kv.shape
        assert torch.equal(tri, ref), (tri.float() - ref.float()).abs().max()
        assert not tri.isnan().any(), "a read touched a slot outside the slot mapping"
        assert (tri[:, :, slots < 0] == 0).all(), "slot -1 must read as zeros"


@pytest.mark.parametrize("storage", STORAGE, ids=str)
@pytest.mark.parametrize("layout", ["whole_blocks", "block_runs", "partial_blocks"])
@pytest.mark.parametrize("block_loop", [False, True], ids=["vectorised", "memcpy_per_block_run"])
def test_reference_matches_naive_loops(storage, layout, block_loop, monkeypatch):
    """The reference's three write paths (per-slot rows, whole-block rows, one memcpy per large block) and its
    read paths against per-token loops."""
    if block_loop:
        monkeypatch.setattr(reference, "LOOP_MIN_BLOCK_BYTES", 0)
    gen = torch.Generator().manual_seed(1)
    block_size, num_blocks, num_layers, num_heads, head_dim = 4, 9, 3, 2, 8
    blocks = torch.randperm(num_blocks, generator=gen)[:5]
    if layout == "block_runs":  # runs of consecutive ids (as a fresh pool hands out): one memcpy per run
        blocks = torch.tensor([2, 3, 4, 8, 0])
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()
    if layout == "partial_blocks":
        slots = slots[torch.randperm(slots.shape[0], generator=gen)][:11]
        slots[4] = -1
    kv = torch.randn((num_layers, 2, slots.shape[0], num_heads, head_dim), generator=gen)
    kv = kv.transpose(3, 4).contiguous().transpose(3, 4)  # non-contiguous engine KV
    ref_pool, ref_scales = make_pool(num_blocks, num_layers, block_size, num_heads, head_dim, storage, "cpu")
    naive_pool, naive_scales = ref_pool.clone(), ref_scales.clone() if ref_scales is not None else None
    write_kv(kv, ref_pool, ref_scales, slots, impl="reference")
    naive_write(kv, naive_pool, naive_scales, slots)
    assert torch.equal(bits(ref_pool), bits(naive_pool))
    if ref_scales is not None:
        assert torch.equal(bits(ref_scales), bits(naive_scales))
    for out_dtype in (torch.float32, torch.bfloat16):
        got = read_kv(ref_pool, ref_scales, slots, out_dtype=out_dtype, impl="reference")
        assert torch.equal(got, naive_read(ref_pool, ref_scales, slots, out_dtype))


@pytest.mark.parametrize("storage", STORAGE, ids=str)
def test_round_trip_within_documented_bound(storage):
    """write then read gives kv back: exactly for fp32/fp16/bf16 storage of same-dtype KV, within
    kcaas_kernels.error_bound (the documented per-element bound) for int8/fp8."""
    gen = torch.Generator().manual_seed(2)
    rows = torch.randn((2, 2, 16, 4, 64), generator=gen)
    rows = rows * torch.logspace(-12, 12, 16, base=2.0)[None, None, :, None, None]  # normal and subnormal fp8
    rows[0, 0, 0, 0] = 0.0
    rows[0, 0, 1, 0] = 0.0
    rows[0, 0, 1, 0, 5] = -3.0  # one non-zero element
    kv = rows.to(storage) if storage not in QUANT_DTYPES else rows
    pool, scales = make_pool(4, 2, 4, 4, 64, storage, "cpu")
    slots = torch.arange(16, dtype=torch.int64)
    write_kv(kv, pool, scales, slots, impl="reference")
    back = read_kv(pool, scales, slots, out_dtype=torch.float32, impl="reference")
    if storage in QUANT_DTYPES:
        assert ((back - rows).abs() <= error_bound(rows, storage)).all()
        assert back[0, 0, 1, 0, 5] == -3.0 and (back[0, 0, 0, 0] == 0).all()
    else:
        assert torch.equal(back, kv.float())


def test_write_kv_skips_all_minus_one():
    pool, scales = make_pool(2, 1, 4, 1, 8, torch.int8, "cpu")
    before = pool.clone()
    write_kv(torch.randn(1, 2, 3, 1, 8), pool, scales, torch.full((3,), -1, dtype=torch.int64))
    assert torch.equal(pool, before) and scales.isnan().all()


def test_read_kv_into_given_buffer():
    """out= is filled in place (stale contents overwritten, zeros for -1) and returned."""
    pool, scales = make_pool(2, 1, 4, 1, 8, torch.int8, "cpu")
    write_kv(torch.randn(1, 2, 2, 1, 8), pool, scales, torch.tensor([5, 0]))
    out = torch.full((1, 2, 3, 1, 8), 9.0)
    got = read_kv(pool, scales, torch.tensor([5, -1, 0]), out_dtype=torch.float32, out=out)
    expected = read_kv(pool, scales, torch.tensor([5, 0]), out_dtype=torch.float32)
    assert got is out and (out[:, :, 1] == 0).all()
    assert torch.equal(out[:, :, [0, 2]], expected)
