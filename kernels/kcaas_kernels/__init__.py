"""KCaaS kernels: write/read KV into paged blocks (with int8/fp8 quantization), copy blocks, paged decode attention.

Each family has a Triton kernel (CUDA; the CPU interpreter in tests) and a plain-torch reference in
kcaas_kernels/reference.py, which is also the production CPU path. ``impl=None`` picks Triton when the pool is on CUDA,
else the reference. Layout, quantization scheme and error bounds: kcaas_kernels/quant.py and docs/kernels.md.
"""

from kcaas_kernels._common import ENGINE_DTYPES, HAS_TRITON, QUANT_DTYPES, STORAGE_DTYPES
from kcaas_kernels.copy_blocks import copy_blocks
from kcaas_kernels.paged_attention import paged_decode_attention
from kcaas_kernels.quant import (
    FP8_E4M3_ABS_ERR_FRACTION_OF_SCALE,
    FP8_E4M3_QMAX,
    FP8_E4M3_REL_ERR,
    INT8_MAX_ABS_ERR_FRACTION_OF_AMAX,
    INT8_QMAX,
    QUANT_FP32_SLACK_ABS,
    QUANT_FP32_SLACK_FRACTION_OF_AMAX,
    QUANT_MAX_ABS_INPUT,
    ROUNDING,
    SCALE_FLOOR,
    dequantize,
    error_bound,
    quantize,
)
from kcaas_kernels.read_kv import read_kv
from kcaas_kernels.write_kv import write_kv

__all__ = [
    "ENGINE_DTYPES",
    "FP8_E4M3_ABS_ERR_FRACTION_OF_SCALE",
    "FP8_E4M3_QMAX",
    "FP8_E4M3_REL_ERR",
    "HAS_TRITON",
    "INT8_MAX_ABS_ERR_FRACTION_OF_AMAX",
    "INT8_QMAX",
    "QUANT_DTYPES",
    "QUANT_FP32_SLACK_ABS",
    "QUANT_FP32_SLACK_FRACTION_OF_AMAX",
    "QUANT_MAX_ABS_INPUT",
    "ROUNDING",
    "SCALE_FLOOR",
    "STORAGE_DTYPES",
    "copy_blocks",
    "dequantize",
    "error_bound",
    "paged_decode_attention",
    "quantize",
    "read_kv",
    "write_kv",
]
