"""Which KV values PagedKVCache.put stores, beyond shape and dtype: those its storage dtype holds faithfully.

Storage of the engine dtype, or of a wider one (fp16 or bf16 KV in fp32, fp16 KV in bf16), holds every value
exactly or rounded (NaN and inf included): nothing is checked there, at no cost. Two kinds of storage cannot:

* int8 / fp8 (kcaas_kernels/quant.py). NaN and inf have no code: stored anyway, a NaN made its row's scale 1.0 (the row
  lost its precision; int8 read the NaN back as 0) and an inf turned its whole row into NaN. Above
  QUANT_MAX_ABS_INPUT (the bf16 maximum, ~3.39e38) the dequantized q * scale can round past the fp32 maximum.
  Refused: any non-finite value, and any |x| > QUANT_MAX_ABS_INPUT.
* A float dtype of smaller range (fp32 KV in fp16 or bf16, bf16 KV in fp16). A finite value from
  ROUNDING[storage].overflow up (65520 for fp16: the maximum plus half an ulp) would be stored, and read back, as
  inf. Refused. NaN and inf themselves are stored as they are (IEEE casts keep them), as in same-dtype storage;
  rounding inside the range is ordinary (kcaas_kernels.error_bound covers it).

A refusal is a KVNotStorable (a ValueError) naming the first offending element, raised before the put plans or
writes anything: the cache is unchanged. The check costs one min/max pass over the KV and one host sync, only for
those two kinds of storage.
"""

import math
from typing import Any

import torch

from gpu_node.errors import NodeError
from kcaas.wire import ErrorCode
from kcaas_kernels import QUANT_DTYPES, QUANT_MAX_ABS_INPUT, ROUNDING

_K_OR_V = ("K", "V")


class KVNotStorable(NodeError, ValueError):
    """KV values this cache's storage dtype cannot hold faithfully (see the module docstring). Nothing was stored.
    The client's to fix: answered `bad_request` (reason kv_not_storable) with the message."""

    code = ErrorCode.BAD_REQUEST

    def details(self) -> dict[str, Any]:
        return {"reason": "kv_not_storable"}


def _name(dtype: torch.dtype) -> str:
    return "fp8_e4m3" if dtype == torch.float8_e4m3fn else str(dtype).removeprefix("torch.")


def _first(mask: torch.Tensor) -> str:
    """Where the first True of a [num_layers, 2, num_tokens, num_kv_heads, head_dim] mask is, for a message."""
    layer, k_or_v, token, head, dim = torch.nonzero(mask)[0].tolist()
    return f"[layer {layer}, {_K_OR_V[k_or_v]}, token {token}, head {head}, dim {dim}]"


def _needs_check(kv_dtype: torch.dtype, storage_dtype: torch.dtype) -> bool:
    if storage_dtype in QUANT_DTYPES:
        return True
    return torch.finfo(storage_dtype).max < torch.finfo(kv_dtype).max


def _min_max(values: torch.Tensor) -> tuple[float, float]:
    """(min, max) with one host sync; NaN if any value is NaN."""
    lo, hi = torch.aminmax(values)
    return tuple(torch.stack([lo, hi]).tolist())


def check_storable(kv: torch.Tensor, storage_dtype: torch.dtype) -> None:
    """Raise KVNotStorable if ``kv`` [num_layers, 2, num_tokens, num_kv_heads, head_dim] holds a value that
    ``storage_dtype`` storage cannot hold faithfully (module docstring); else return without changing anything."""
    if kv.numel() == 0 or not _needs_check(kv.dtype, storage_dtype):
        return
    kv = kv.detach()
    lo, hi = _min_max(kv)
    finite = math.isfinite(lo) and math.isfinite(hi)
    name = _name(storage_dtype)
    if storage_dtype in QUANT_DTYPES:
        if not finite:
            bad = ~kv.isfinite()
            raise KVNotStorable(
                f"kv holds {int(bad.sum())} non-finite value(s) (NaN or +-inf; the first at {_first(bad)}): "
                f"{name} storage cannot represent them; nothing was stored"
            )
        if max(-lo, hi) > QUANT_MAX_ABS_INPUT:
            beyond = kv.float().abs() > QUANT_MAX_ABS_INPUT  # compared in fp32, not rounded to kv's dtype
            raise KVNotStorable(
                f"kv holds |x| = {max(-lo, hi):.6g} at {_first(beyond)}, beyond what {name} storage takes (finite "
                f"|x| <= {QUANT_MAX_ABS_INPUT:.6g}, the bfloat16 maximum: larger values can overflow when "
                "dequantized); nothing was stored"
            )
        return
    overflow = ROUNDING[storage_dtype].overflow
    if not finite:  # NaN/inf are stored as they are; look at the finite values only (rare: a second pass)
        finite_values = kv[kv.isfinite()]
        if finite_values.numel() == 0:
            return
        lo, hi = _min_max(finite_values)
    if max(-lo, hi) >= overflow:
        beyond = kv.isfinite() & (kv.float().abs() >= overflow)
        raise KVNotStorable(
            f"kv holds a finite value of magnitude {max(-lo, hi):.6g} at {_first(beyond)}, beyond {name} storage's "
            f"range (from {overflow:.6g} up values round to inf there; its maximum is "
            f"{torch.finfo(storage_dtype).max:.6g}); nothing was stored"
        )
