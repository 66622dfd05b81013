"""Triton jit helpers shared by the kernels: exact rounding, quantize/dequantize of [..., D] tiles, output casts.

Why explicit rounding instead of plain casts (all found by running triton 3.9's interpreter against torch):
  * float -> int8 ``.to(tl.int8)`` truncates toward zero (on CUDA too: fptosi), so int8 needs an explicit rint.
    ``libdevice.rint`` is an extern call the interpreter refuses, so ``_rint`` uses the fp32 trick
    (x + 1.5*2**23) - 1.5*2**23, which is round-half-to-even for |x| < 2**22 on every IEEE fp32 unit and
    matches ``torch.round`` bit for bit. (Triton does not reassociate fp adds; the sm_90 PTX keeps the add/sub.)
  * fp32 -> float8e4nv and fp32 -> bfloat16 casts are wrong in the interpreter (a mantissa carry is dropped, so
    1.99 -> 1.0; ties are not to even; e4m3 subnormals are off; fp32 subnormal inputs are mangled).
    ``_round_to_e4m3`` rounds in fp32 first (nearest even, like torch and the cvt.rn.satfinite.e4m3x2.f32 that
    Triton emits on sm_90), after which the cast is exact on the interpreter and the GPU; ``_to_bf16_rne`` builds
    the bfloat16 bits with integer ops and never uses the float cast. Decoding fp8 -> fp32 is exact in the
    interpreter for all finite bytes (the NaN bytes 0x7f/0xff decode as +-480 there; pools never hold them).
  * Divisions use ``tl.math.div_rn`` (IEEE, correctly rounded); plain ``/`` is an approximate division on CUDA
    and would break bit-equality with the torch reference.
"""

from kcaas_kernels._common import tl, triton

INT8_QMAX = tl.constexpr(127.0)
FP8_E4M3_QMAX = tl.constexpr(448.0)
SCALE_FLOOR = tl.constexpr(2.0**-126)  # kcaas_kernels.quant.SCALE_FLOOR: the smallest normal fp32


@triton.jit
def _rint(x):
    """Round fp32 to the nearest integer, ties to even, for |x| < 2**22."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _round_to_e4m3(y):
    """Round fp32 |y| <= 448 to the nearest e4m3 value (ties to even), still as fp32.

    Adding M = 1.5 * 2**(e+20), whose ulp is 2**(e-3), rounds |y| in [2**e, 2**(e+1)) to the e4m3 step 2**(e-3);
    below 2**-6 the exponent is clamped so the step stays 2**-9 (the e4m3 subnormal spacing).
    """
    y_bits = y.to(tl.int32, bitcast=True)
    mag = tl.abs(y)
    exponent = (y_bits >> 23) & 0xFF
    exponent = tl.maximum(exponent, 121)  # 121 - 127 = -6, the smallest normal e4m3 exponent
    magic = (((exponent + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)
    rounded = (mag + magic) - magic
    # Put y's sign bit back (also on zeros, so -0.0 stays -0.0 like torch's cast).
    return (rounded.to(tl.int32, bitcast=True) | (y_bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _to_bf16_rne(x):
    """fp32 -> bfloat16, round to nearest even, by integer ops on the bits (finite inputs)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _cast_rne(x, DST: tl.constexpr):
    """Cast fp32 ``x`` to the float dtype DST, rounding to nearest even on every backend."""
    if DST == tl.bfloat16:
        y = _to_bf16_rne(x)
    else:
        y = x.to(DST)
    return y


@triton.jit
def _quantize_rows(x, QDTYPE: tl.constexpr, AXIS: tl.constexpr):
    """Quantize fp32 ``x`` per row along AXIS (head_dim); returns (q as QDTYPE, fp32 scale without AXIS)."""
    if QDTYPE == tl.int8:
        qmax = INT8_QMAX
    else:
        qmax = FP8_E4M3_QMAX
    amax = tl.max(tl.abs(x), axis=AXIS)
    scale = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, qmax, tl.float32)), SCALE_FLOOR)
    scale = tl.where(amax > 0, scale, 1.0)
    y = tl.math.div_rn(x, tl.expand_dims(scale, AXIS))
    if QDTYPE == tl.int8:
        q = tl.minimum(tl.maximum(_rint(y), -INT8_QMAX), INT8_QMAX).to(tl.int8)
    else:
        q = _round_to_e4m3(tl.minimum(tl.maximum(y, -FP8_E4M3_QMAX), FP8_E4M3_QMAX)).to(tl.float8e4nv)
    return q, scale
