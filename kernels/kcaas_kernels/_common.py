"""Shared plumbing for the kernel wrappers: the Triton import guard, the dispatch rule and input checks.

Dispatch rule (``impl``):
  * ``None``        -> "triton" when the pool is on a CUDA device and Triton imports, else "reference".
  * ``"reference"`` -> the plain-torch implementation in kcaas_kernels/reference.py (the production CPU path).
  * ``"triton"``    -> the Triton kernel. On CPU tensors this only works when Triton's interpreter is active
                       (``TRITON_INTERPRET=1`` set before the kernel modules were imported); otherwise ValueError.

The value checks (slot ranges, block ids) read the index tensors once on the host: one device sync per call on
CUDA. The indices are small next to the KV bytes they address, and an out-of-range index would otherwise be a
silent out-of-bounds write.
"""

import types

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # reference-only install: the kernel modules still import, "triton" is refused at call time
    HAS_TRITON = False
    triton = types.SimpleNamespace(jit=lambda fn=None, **_: fn, cdiv=lambda a, b: -(-a // b))
    tl = types.SimpleNamespace(constexpr=lambda value=None: value)

IMPLS = ("triton", "reference")
TARGET_BYTES_PER_PROGRAM = 16384  # write/read kernels: engine-side bytes one GPU program moves

# Engine-side dtypes (what engines write and read back) and pool storage dtypes.
ENGINE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)
STORAGE_DTYPES = ENGINE_DTYPES + QUANT_DTYPES


def scrub(*temporaries: torch.Tensor, keep: tuple = ()) -> None:
    """Zero temporaries that held KV before they are freed (no plaintext KV left in freed heap memory after an
    erasure), except those sharing storage with a tensor in `keep` (the caller's input or the pool itself)."""
    kept = {t.untyped_storage().data_ptr() for t in keep}
    for t in temporaries:
        if t.numel() and t.untyped_storage().data_ptr() not in kept:
            t.zero_()


def is_interpreted(kernel) -> bool:
    """True when ``kernel`` was built by Triton's CPU interpreter (TRITON_INTERPRET=1 at import time)."""
    if not HAS_TRITON:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def resolve_impl(impl: str | None, device: torch.device, kernel) -> str:
    """Apply the dispatch rule for tensors living on ``device``; ``kernel`` is the family's jit function."""
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} or None, got {impl!r}")
    if impl is None:
        return "triton" if (device.type == "cuda" and HAS_TRITON) else "reference"
    if impl == "triton":
        if not HAS_TRITON:
            raise ValueError("impl='triton' needs the triton package, which is not installed")
        if device.type == "cpu" and not is_interpreted(kernel):
            raise ValueError("impl='triton' on CPU tensors needs TRITON_INTERPRET=1 set before kernels is imported")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"impl='triton' supports cuda (or cpu under the interpreter), not {device.type}")
    return impl


def layers_per_program(num_layers: int, layer_bytes: int, kernel) -> int:
    """Layers one write/read program handles: all of them under the interpreter (it pays per program, not per
    byte), else enough for ~TARGET_BYTES_PER_PROGRAM engine-side bytes per program."""
    if is_interpreted(kernel):
        return num_layers
    return max(1, min(num_layers, TARGET_BYTES_PER_PROGRAM // layer_bytes))


def check_pool(pool: torch.Tensor, scales: torch.Tensor | None, name: str = "pool") -> None:
    """A pool is [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], contiguous (block-major)."""
    if not isinstance(pool, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(pool).__name__}")
    if pool.dim() != 6 or pool.shape[2] != 2:
        raise ValueError(
            f"{name} must have shape [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], "
            f"got {tuple(pool.shape)}"
        )
    if pool.dtype not in STORAGE_DTYPES:
        raise ValueError(f"{name} dtype must be one of {STORAGE_DTYPES}, got {pool.dtype}")
    if not pool.is_contiguous():
        raise ValueError(f"{name} must be contiguous (one block is one contiguous run of bytes)")
    if pool.dtype in QUANT_DTYPES:
        if scales is None:
            raise ValueError(f"{name} is quantized ({pool.dtype}): its scales tensor is required")
        expected = tuple(pool.shape[:5])
        if tuple(scales.shape) != expected or scales.dtype != torch.float32:
            raise ValueError(
                f"{name} scales must be float32 of shape {expected} "
                f"(one per slot, layer, K/V, head), got {scales.dtype} {tuple(scales.shape)}"
            )
        if scales.device != pool.device or not scales.is_contiguous():
            raise ValueError(f"{name} scales must be contiguous and on {pool.device}, got {scales.device}")
    elif scales is not None:
        raise ValueError(f"{name} dtype {pool.dtype} is not quantized: scales must be None")


def check_same_device(pool: torch.Tensor, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != pool.device:
            raise ValueError(f"{name} is on {t.device} but the pool is on {pool.device}")


def check_index_tensor(t: torch.Tensor, name: str, dtype: torch.dtype, dim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of {dtype}, got {type(t).__name__}")
    if t.dtype != dtype or t.dim() != dim:
        raise ValueError(f"{name} must be a {dim}-D {dtype} tensor, got {t.dim()}-D {t.dtype}")


def check_slot_mapping(slot_mapping: torch.Tensor, num_tokens: int | None, num_slots: int) -> None:
    """Slots are block_id * block_size + offset, or -1 (skip / zeros); ``num_tokens`` None: any length."""
    check_index_tensor(slot_mapping, "slot_mapping", torch.int64, 1)
    num_tokens = slot_mapping.shape[0] if num_tokens is None else num_tokens
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    if num_tokens == 0:
        return
    lo, hi = torch.stack([slot_mapping.min(), slot_mapping.max()]).tolist()
    if lo < -1 or hi >= num_slots:
        raise ValueError(f"slot_mapping values must lie in [-1, {num_slots}), got min {lo}, max {hi}")


def check_block_ids(ids: torch.Tensor, name: str, num_blocks: int) -> None:
    if ids.numel() == 0:
        return
    lo, hi = torch.stack([ids.min(), ids.max()]).tolist()
    if lo < 0 or hi >= num_blocks:
        raise ValueError(f"{name} values must lie in [0, {num_blocks}), got min {lo}, max {hi}")
