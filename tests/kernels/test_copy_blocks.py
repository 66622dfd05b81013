"""copy_blocks: copy-on-write inside one pool and tiering between two pools, Triton vs reference, bit for bit."""

import pytest
import torch

from kcaas_kernels import QUANT_DTYPES, copy_blocks, reference, write_kv
from tests.kernels.helpers import STORAGE, TRITON_DEVICES, bits, make_pool


def _filled_pool(storage, device, num_blocks=7, seed=0):
    """A garbage pool whose blocks 0..4 hold written KV (block size 16, 2 layers, 3 heads, head_dim 8)."""
    pool, scales = make_pool(num_blocks, 2, 16, 3, 8, storage, "cpu", seed=seed)
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn((2, 2, 5 * 16 - 3, 3, 8), generator=gen)  # the last block is partial
    write_kv(kv, pool, scales, torch.arange(kv.shape[2]), impl="reference")
    return pool.to(device), (scales.to(device) if scales is not None else None)


def _clone(pool, scales):
    return pool.clone(), (scales.clone() if scales is not None else None)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("storage", STORAGE, ids=str)
def test_copy_on_write_within_one_pool(device, storage):
    pool, scales = _filled_pool(storage, device)
    src, dst = torch.tensor([4, 0, 2]), torch.tensor([5, 3, 6])  # the partial block 4 included
    results = []
    for impl in ("reference", "triton"):
        p, s = _clone(pool, scales)
        copy_blocks(p, s, p, s, src, dst, impl=impl)
        results.append((p, s))
    (ref_pool, ref_scales), (tri_pool, tri_scales) = results
    assert torch.equal(bits(tri_pool), bits(ref_pool))
    assert torch.equal(bits(ref_pool[dst]), bits(pool[src]))  # NaN garbage of the partial block copied as is
    assert torch.equal(bits(ref_pool[[0, 1, 2, 4]]), bits(pool[[0, 1, 2, 4]]))
    if storage in QUANT_DTYPES:
        assert torch.equal(bits(tri_scales), bits(ref_scales))
        assert torch.equal(bits(ref_scales[dst]), bits(scales[src]))


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("storage", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_copy_between_two_pools(device, storage):
    src_pool, src_scales = _filled_pool(storage, device, num_blocks=7, seed=1)
    results = []
    for impl in ("reference", "triton"):
        dst_pool, dst_scales = make_pool(4, 2, 16, 3, 8, storage, device, seed=2)
        copy_blocks(src_pool, src_scales, dst_pool, dst_scales, [1, 4, 0], [3, 0, 2], impl=impl)
        results.append((dst_pool, dst_scales))
    (ref_pool, ref_scales), (tri_pool, tri_scales) = results
    assert torch.equal(bits(tri_pool), bits(ref_pool))
    assert torch.equal(bits(ref_pool[[3, 0, 2]]), bits(src_pool[[1, 4, 0]]))
    if storage in QUANT_DTYPES:
        assert torch.equal(bits(tri_scales), bits(ref_scales))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.cuda
def test_copy_between_devices_uses_torch():
    """Tiering: a CPU pool into a CUDA pool and back (the torch path, whatever impl says)."""
    cpu_pool, cpu_scales = _filled_pool(torch.int8, "cpu")
    gpu_pool, gpu_scales = make_pool(3, 2, 16, 3, 8, torch.int8, "cuda")
    copy_blocks(cpu_pool, cpu_scales, gpu_pool, gpu_scales, [2, 0], [0, 1], impl="triton")
    back_pool, back_scales = make_pool(2, 2, 16, 3, 8, torch.int8, "cpu")
    copy_blocks(gpu_pool, gpu_scales, back_pool, back_scales, torch.tensor([0, 1], device="cuda"), [1, 0])
    assert torch.equal(back_pool[[1, 0]], cpu_pool[[2, 0]])
    assert torch.equal(bits(back_scales[[1, 0]]), bits(cpu_scales[[2, 0]]))


def test_copy_blocks_empty_is_a_no_op():
    pool, scales = _filled_pool(torch.float16, "cpu")
    before = pool.clone()
    copy_blocks(pool, scales, pool, scales, [], [])
    assert torch.equal(bits(pool), bits(before))


@pytest.mark.parametrize("storage", [torch.float16, torch.float8_e4m3fn], ids=str)
def test_reference_memcpy_per_block_path(storage, monkeypatch):
    """Large blocks take one copy_ per block in the reference; forced here on small ones, same result."""
    pool, scales = _filled_pool(storage, "cpu")
    expected_pool, expected_scales = _clone(pool, scales)
    copy_blocks(expected_pool, expected_scales, expected_pool, expected_scales, [4, 0], [6, 5])
    monkeypatch.setattr(reference, "LOOP_MIN_BLOCK_BYTES", 0)
    copy_blocks(pool, scales, pool, scales, torch.tensor([4, 0]), torch.tensor([6, 5]))
    assert torch.equal(bits(pool), bits(expected_pool))
    if scales is not None:
        assert torch.equal(bits(scales), bits(expected_scales))
