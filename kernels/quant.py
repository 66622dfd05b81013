"""KV quantization scheme (int8 and fp8 e4m3), its error bounds, and the plain-torch quantize/dequantize.

Scheme: symmetric, one fp32 scale per (slot, layer, K/V, head), i.e. per token per head, over head_dim.
Why per token-head: slots are written independently (a partial block is appended to token by token, copy-on-write
copies whole blocks), so a quantization group must never span tokens written at different times; a per-head scale
keeps one outlier head from flattening the others.

For one row x = kv[layer, k_or_v, token, head, :] (computed in fp32; inputs must be finite):
  amax  = max |x|
  int8: scale = amax / 127   (1.0 when amax == 0);  q = clamp(rint(x / scale), -127, 127)
        rint rounds half to even (torch.round; the Triton kernels use the fp32 1.5*2**23 trick, same result).
  fp8 : scale = amax / 448   (1.0 when amax == 0);  q = e4m3(clamp(x / scale, -448, 448)), round to nearest even.
  dequant: q.float() * scale.
All divisions are correctly rounded IEEE fp32 divisions (torch on tensors, ``tl.math.div_rn`` in Triton), so the
reference and the Triton kernels produce bit-identical q and scale.

Error bounds, per element, for the dequantized x_hat (named constants the engine tests import):
  int8: |x_hat - x| <= amax * INT8_MAX_ABS_ERR_FRACTION_OF_AMAX                       (= scale / 2)
  fp8 : |x_hat - x| <= |x| * FP8_E4M3_REL_ERR + scale * FP8_E4M3_ABS_ERR_FRACTION_OF_SCALE
        (relative half-ulp 2**-4 for normal e4m3 values; absolute half-step 2**-10 of the scale for subnormals)
Both bounds hold up to a few fp32 ulps of amax from the fp32 division and multiplication (covered by
``QUANT_FP32_SLACK_FRACTION_OF_AMAX``).
"""

import torch

INT8_QMAX = 127.0
FP8_E4M3_QMAX = 448.0

INT8_MAX_ABS_ERR_FRACTION_OF_AMAX = 1 / 254
FP8_E4M3_REL_ERR = 2**-4
FP8_E4M3_ABS_ERR_FRACTION_OF_SCALE = 2**-10
# fp32 rounding of x / scale and q * scale: a few ulps of amax on top of the bounds above.
QUANT_FP32_SLACK_FRACTION_OF_AMAX = 2**-20


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
    scale = torch.where(amax > 0, amax / torch.full_like(amax, qmax), torch.ones_like(amax))
    y = x.div_(scale.unsqueeze(-1))
    if dtype == torch.int8:
        return y.round_().clamp_(-INT8_QMAX, INT8_QMAX).to(torch.int8), scale
    return y.clamp_(-FP8_E4M3_QMAX, FP8_E4M3_QMAX).to(torch.float8_e4m3fn), scale


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize rows over the last dim: returns (q of ``dtype`` shaped like x, fp32 scales of x.shape[:-1])."""
    qmax = qmax_for(dtype)
    rows = x.reshape(-1, x.shape[-1])
    q = torch.empty(rows.shape, dtype=dtype, device=x.device)
    scale = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    for part in _row_chunks(rows.shape[0], rows.shape[1], x.device):
        q[part], scale[part] = _quantize_chunk(rows[part], dtype, qmax)
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
        out_rows[part] = q_rows[part].to(torch.float32, copy=True).mul_(scale_rows[part])
    return out


def error_bound(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The documented per-element bound on |dequantize(quantize(x)) - x| for rows of x (last dim)."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    slack = amax * QUANT_FP32_SLACK_FRACTION_OF_AMAX
    if dtype == torch.int8:
        return amax * INT8_MAX_ABS_ERR_FRACTION_OF_AMAX + slack
    scale = torch.where(amax > 0, amax / FP8_E4M3_QMAX, torch.ones_like(amax))
    return x.abs() * FP8_E4M3_REL_ERR + scale * FP8_E4M3_ABS_ERR_FRACTION_OF_SCALE + slack
