"""The Triton rounding helpers against torch, exhaustively where it matters (every e4m3 tie, int8 ties).

These pin down the interpreter findings in kcaas_kernels/_triton_math.py: with the helpers, Triton rounds exactly as
torch does (round half to even) on the interpreter and on CUDA alike.
"""

import pytest
import torch

from kcaas_kernels import HAS_TRITON
from kcaas_kernels._common import tl, triton
from kcaas_kernels._triton_math import _cast_rne, _rint, _round_to_e4m3
from tests.kernels.helpers import TRITON_DEVICES, bits

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")


@triton.jit
def _to_e4m3_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)
    tl.store(y_ptr + offsets, _round_to_e4m3(x).to(tl.float8e4nv), mask=offsets < n)


@triton.jit
def _rint_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)
    tl.store(y_ptr + offsets, _rint(x).to(tl.int8), mask=offsets < n)


@triton.jit
def _cast_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)
    tl.store(y_ptr + offsets, _cast_rne(x, y_ptr.dtype.element_ty), mask=offsets < n)


def _run(kernel, x, out_dtype):
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    block = triton.next_power_of_2(x.numel())
    kernel[(1,)](x, y, x.numel(), BLOCK=block)
    return y


def _e4m3_test_values(device):
    """Every finite e4m3 value, every midpoint between neighbours (the ties), points just off them, and
    random values over the whole range including subnormals and underflow."""
    grid = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (grid[:-1] + grid[1:]) / 2
    gen = torch.Generator().manual_seed(0)
    noise = torch.exp(torch.empty(4096).uniform_(-14.0, 6.1, generator=gen)).clamp(max=448.0)
    values = torch.cat([grid, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(500.0)), noise])
    return torch.cat([values, -values]).to(device)


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_round_to_e4m3_matches_torch_cast(device):
    x = _e4m3_test_values(device)
    assert torch.equal(bits(_run(_to_e4m3_kernel, x, torch.float8_e4m3fn)), bits(x.to(torch.float8_e4m3fn)))


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_rint_rounds_half_to_even_like_torch_round(device):
    halves = torch.arange(-127, 127) + 0.5
    x = torch.cat([halves, halves.nextafter(torch.tensor(0.0)), torch.linspace(-127, 127, 1001)]).to(device)
    assert torch.equal(_run(_rint_kernel, x, torch.int8), torch.round(x).to(torch.int8))


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cast_rne_matches_torch(device, out_dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4096, generator=gen) * torch.logspace(-30, 30, 4096, base=2.0)
    ties = torch.arange(0, 2**16, 97, dtype=torch.int32).mul(2**16).add(2**15).view(torch.float32)  # bf16 ties
    x = torch.cat([x, ties[ties.isfinite()], torch.tensor([1.99609375, 255.9, -0.0])]).to(device)
    if out_dtype == torch.float16:
        x = x.clamp(-60000, 60000)
    assert torch.equal(bits(_run(_cast_kernel, x, out_dtype)), bits(x.to(out_dtype)))
