"""KV quantization scheme (int8 and fp8 e4m3), its error bounds, and the plain-torch quantize/dequantize.

Scheme: symmetric, one fp32 scale per (slot, layer, K/V, head), i.e. per token per head, over head_dim.
Why per token-head: slots are written independently (a partial block is appended to token by token, copy-on-write
copies whole blocks), so a quantization group must never span tokens written at different times; a per-head scale
keeps one outlier head from flattening the others.

For one row x = kv[layer, k_or_v, token, head, :] (computed in fp32), with amax = max |x|:
  int8: scale = max(amax / 127, SCALE_FLOOR)   (1.0 when amax == 0);  q = clamp(rint(x / scale), -127, 127)
        rint rounds half to even (torch.round; the Triton kernels use the fp32 1.5*2**23 trick, same result).
  fp8 : scale = max(amax / 448, SCALE_FLOOR)   (1.0 when amax == 0);  q = e4m3(clamp(x / scale, -448, 448)),
        round to nearest even.
  dequant: q.float() * scale in fp32, then rounded (to nearest even) to the dtype read back.
All divisions are correctly rounded IEEE fp32 divisions (torch on tensors, ``tl.math.div_rn`` in Triton), so the
reference and the Triton kernels produce bit-identical q and scale.

Inputs: finite, |x| <= QUANT_MAX_ABS_INPUT (the bfloat16 maximum, so every fp16/bf16 value and all but the top
1/128 of the fp32 range). NaN and inf have no int8/fp8 code (a NaN makes its row's scale 1.0, so the row loses
its precision and int8 reads the NaN back as 0; an inf makes its whole row NaN), and above QUANT_MAX_ABS_INPUT
q * scale can round past the fp32 maximum. The kernels do not check this (a pass and
a device sync per write); the engine refuses such KV before storing anything (gpu_node/engine/kv_input.py).

SCALE_FLOOR = 2**-126, the smallest normal fp32. Without it amax / qmax is an fp32 subnormal below amax =
qmax * 2**-126 (~1.5e-36 int8, ~5.3e-36 fp8) and loses significant bits (int8 errors beyond the bound were seen
below amax ~1e-41), then 0 (below amax ~9e-44 int8, ~3e-43 fp8: x / 0 reads back NaN for fp8, 0 for int8). With
the floor the scale is always a normal number, |x / scale| <= qmax (no overflow: |x| <= amax <= qmax * scale),
and a floored row is only coarser in absolute terms: x / 2**-126 and q * 2**-126 are exact, so its int8 error is
at most SCALE_FLOOR / 2 ~ 5.9e-39.

Error bounds, per element, for the value x_hat read back (named constants the engine tests import; ``error_bound``
computes them), with scale = max(amax / qmax, SCALE_FLOOR) as above:
  quantization, in fp32 (e_q):
    int8: |x_hat - x| <= max(amax * INT8_MAX_ABS_ERR_FRACTION_OF_AMAX, SCALE_FLOOR / 2) + slack   (= scale / 2)
    fp8 : |x_hat - x| <= |x| * FP8_E4M3_REL_ERR + scale * FP8_E4M3_ABS_ERR_FRACTION_OF_SCALE + slack
          (relative half-ulp 2**-4 for normal e4m3 values; absolute half-step 2**-10 of the scale for subnormals)
    slack = amax * QUANT_FP32_SLACK_FRACTION_OF_AMAX + QUANT_FP32_SLACK_ABS: a few fp32 ulps of amax from the
    division and multiplication, and one fp32 subnormal step where q * scale is an fp32 subnormal (fp8 only).
  read back in an fp16/bf16 engine dtype (the fp32 value v rounded once more, ROUNDING[dtype]):
    |x_hat - x| <= e_q + |v|max * rel_err + abs_err,   |v|max = min(|x| + e_q, qmax * scale * (1 + 2**-20))
    rel_err = 2**-11 (fp16) / 2**-8 (bf16), a half-ulp; abs_err = 2**-25 (fp16) / 2**-134 (bf16), half the
    smallest subnormal step. fp16 overflows to inf from 65520 (ROUNDING[float16].overflow): never for KV put in
    fp16 (|x| <= 65504 gives |v| <= 65504 * (1 + 2**-22) < 65520); error_bound is inf where |v|max reaches it
    (fp32 KV read back as fp16). Read back in fp32, nothing is added.
Unquantized storage of another dtype (fp32 KV in fp16, bf16 in fp16, ...) rounds once on write with the storage
dtype's ROUNDING (finite values beyond its range would become inf: refused by the engine) and once more on read if
the engine dtype is narrower; same-dtype and fp32 storage are exact. ``error_bound`` covers these too.
"""

from dataclasses import dataclass

import torch

from kcaas_kernels._common import scrub

INT8_QMAX = 127.0
FP8_E4M3_QMAX = 448.0
SCALE_FLOOR = 2.0**-126  # torch.finfo(torch.float32).tiny: scales are never 0 or subnormal
QUANT_MAX_ABS_INPUT = float(torch.finfo(torch.bfloat16).max)  # (2 - 2**-7) * 2**127 ~ 3.39e38

INT8_MAX_ABS_ERR_FRACTION_OF_AMAX = 1 / 254
FP8_E4M3_REL_ERR = 2**-4
FP8_E4M3_ABS_ERR_FRACTION_OF_SCALE = 2**-10
# fp32 rounding of x / scale and q * scale: a few ulps of amax on top of the bounds above, and one fp32 subnormal
# step for an fp8 product q * scale below 2**-126.
QUANT_FP32_SLACK_FRACTION_OF_AMAX = 2**-20
QUANT_FP32_SLACK_ABS = 2.0**-149


@dataclass(frozen=True, slots=True)
class Rounding:
    """Round-to-nearest-even into a float dtype: |rn(v) - v| <= |v| * rel_err + abs_err while |v| < overflow."""

    rel_err: float  # half an ulp, relative (normal results)
    abs_err: float  # half the smallest subnormal step (subnormal results)
    overflow: float  # the smallest magnitude that rounds to inf: max + half an ulp


ROUNDING = {
    torch.float32: Rounding(2**-24, 2.0**-150, (2 - 2**-24) * 2.0**127),
    torch.float16: Rounding(2**-11, 2.0**-25, 65520.0),
    torch.bfloat16: Rounding(2**-8, 2.0**-134, (2 - 2**-8) * 2.0**127),
}


def qmax_for(dtype: torch.dtype) -> float:
    if dtype == torch.int8:
        return INT8_QMAX
    if dtype == torch.float8_e4m3fn:
        return FP8_E4M3_QMAX
    raise ValueError(f"{dtype} is not a quantized storage dtype (int8 or float8_e4m3fn)")


# On CPU, rows are (de)quantized in chunks of this many elements so the fp32 temporaries stay small and reused
# (cache-resident, no fresh pages to fault in); results do not depend on the chunking.
CPU_CHUNK_ELEMENTS = 1 << 18


def _row_chunks(num_rows: int, row_len: int, device: torch.device):
    step = num_rows if device.type != "cpu" else max(1, CPU_CHUNK_ELEMENTS // max(row_len, 1))
    for start in range(0, num_rows, step):
        yield slice(start, start + step)


def _quantize_chunk(x: torch.Tensor, dtype: torch.dtype, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.to(torch.float32, copy=True)  # a private copy: divided in place below
    amax = x.abs().amax(dim=-1)
    # A tensor divisor, not a Python scalar: torch may turn division by a scalar into a multiplication by its
    # reciprocal, which is not always the correctly rounded quotient the kernels compute.
    scale = (amax / torch.full_like(amax, qmax)).clamp_(min=SCALE_FLOOR)
    scale = torch.where(amax > 0, scale, torch.ones_like(amax))
    y = x.div_(scale.unsqueeze(-1))
    if dtype == torch.int8:
        q = y.round_().clamp_(-INT8_QMAX, INT8_QMAX).to(torch.int8)
    else:
        q = y.clamp_(-FP8_E4M3_QMAX, FP8_E4M3_QMAX).to(torch.float8_e4m3fn)
    x.zero_()  # the private copy held KV: zeroed before it is freed
    return q, scale


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize rows over the last dim: returns (q of ``dtype`` shaped like x, fp32 scales of x.shape[:-1])."""
    qmax = qmax_for(dtype)
    rows = x.reshape(-1, x.shape[-1])
    q = torch.empty(rows.shape, dtype=dtype, device=x.device)
    scale = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    for part in _row_chunks(rows.shape[0], rows.shape[1], x.device):
        chunk_q, scale[part] = _quantize_chunk(rows[part], dtype, qmax)
        q[part] = chunk_q
        chunk_q.view(torch.uint8).zero_()  # temporaries that held KV are zeroed before they are freed
    scrub(rows, keep=(x,))  # reshaping a strided x (a put's uncached suffix) copied it
    return q.view(x.shape), scale.view(x.shape[:-1])


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Inverse of ``quantize``: q.float() * scale (broadcast over the last dim), cast to ``out_dtype``.

    ``out``: optional contiguous destination shaped like q (its dtype wins over ``out_dtype``).
    """
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device) if out is None else out
    q_rows, out_rows = q.reshape(-1, q.shape[-1]), out.view(-1, q.shape[-1])
    scale_rows = scale.reshape(-1, 1)
    for part in _row_chunks(q_rows.shape[0], q_rows.shape[1], q.device):
        chunk = q_rows[part].to(torch.float32, copy=True).mul_(scale_rows[part])
        out_rows[part] = chunk
        chunk.zero_()  # held KV: zeroed before it is freed
    scrub(q_rows, keep=(q,))  # reshaping a strided q copied it
    return out


def _holds(wide: torch.dtype, narrow: torch.dtype) -> bool:
    """Every ``narrow`` value is exactly a ``wide`` value (among the float engine/storage dtypes)."""
    return wide == narrow or wide == torch.float32 and narrow in (torch.float16, torch.bfloat16)


def error_bound(x: torch.Tensor, dtype: torch.dtype, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The documented per-element bound on |read - x| for rows of x (last dim) written into ``dtype`` storage
    (int8/fp8, or a float dtype) and read back as ``out_dtype`` (default x.dtype, as the engine does), in float64.

    inf where no bound is promised: non-finite x, a row beyond QUANT_MAX_ABS_INPUT (quantized storage), a value
    beyond the float storage's range, or one whose read could overflow ``out_dtype``.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    mag = x.double().abs()
    inf = torch.tensor(float("inf"), dtype=torch.float64, device=x.device)
    if dtype in (torch.int8, torch.float8_e4m3fn):
        amax = mag.amax(dim=-1, keepdim=True)
        scale = torch.where(amax > 0, (amax / qmax_for(dtype)).clamp(min=SCALE_FLOOR), 1.0)
        slack = amax * QUANT_FP32_SLACK_FRACTION_OF_AMAX + QUANT_FP32_SLACK_ABS
        if dtype == torch.int8:
            err = (amax * INT8_MAX_ABS_ERR_FRACTION_OF_AMAX).clamp(min=SCALE_FLOOR / 2) + slack
            err = err.expand_as(mag)
        else:
            err = mag * FP8_E4M3_REL_ERR + scale * FP8_E4M3_ABS_ERR_FRACTION_OF_SCALE + slack
        err = torch.where(amax <= QUANT_MAX_ABS_INPUT, err, inf)  # NaN amax compares False: inf
        # |q| <= qmax, so the fp32 value never exceeds qmax * scale (up to its two roundings)
        hat_max = torch.minimum(mag + err, qmax_for(dtype) * scale * (1 + QUANT_FP32_SLACK_FRACTION_OF_AMAX))
        read_exact = out_dtype == torch.float32  # dequantized in fp32
    else:
        stored, exact = ROUNDING[dtype], _holds(dtype, x.dtype)
        err = torch.zeros_like(mag) if exact else mag * stored.rel_err + stored.abs_err
        err = torch.where(mag < stored.overflow, err, inf)
        hat_max = mag + err
        read_exact = _holds(out_dtype, dtype) or exact and _holds(out_dtype, x.dtype)  # x itself comes back
    if not read_exact:
        read = ROUNDING[out_dtype]
        err = err + hat_max * read.rel_err + read.abs_err
        err = torch.where(hat_max < read.overflow, err, inf)
    return err
