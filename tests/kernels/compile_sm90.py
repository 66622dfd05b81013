"""Compile every kernel for sm_90 (Triton front end, LLVM and the bundled ptxas) without a GPU; no launch.

The interpreter runs kernels as numpy and accepts code the compiler rejects (and vice versa), so on a machine
without a GPU this is the check that the kernels compile at all. Run as a script, with TRITON_INTERPRET unset:
    python -m tests.kernels.compile_sm90        (exit status 1 and the errors when a variant fails)
"""

import itertools
import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kcaas_kernels.copy_blocks import _copy_blocks_kernel
from kcaas_kernels.paged_attention import _merge_splits_kernel, _num_warps, _paged_decode_kernel
from kcaas_kernels.read_kv import _read_kv_kernel
from kcaas_kernels.write_kv import _write_kv_kernel

TARGET = GPUTarget("cuda", 90, 32)
PTR = {"fp32": "*fp32", "fp16": "*fp16", "bf16": "*bf16", "int8": "*i8", "fp8": "*fp8e4nv"}
QUANT = ("int8", "fp8")


def _compile(kernel, arg_types: dict, constexprs: dict, num_warps: int = 4) -> None:
    signature = {name: ("constexpr" if name in constexprs else arg_types.get(name, "i32")) for name in kernel.arg_names}
    fp_fusion = kernel in (_paged_decode_kernel, _merge_splits_kernel)  # as the launchers set it
    options = {"num_warps": num_warps, "enable_fp_fusion": fp_fusion}
    triton.compile(ASTSource(kernel, signature, constexprs), target=TARGET, options=options)


def _write_read_variants():
    for engine, storage in itertools.product(["fp32", "fp16", "bf16"], ["fp32", "fp16", "bf16", "int8", "fp8"]):
        quantized = storage in QUANT
        shape = dict(BLOCK_SIZE=16, NUM_HEADS=3, HEAD_DIM=128, BLOCK_H=4, BLOCK_D=128, LAYERS_PER_PROGRAM=2)
        scales = "*fp32" if quantized else PTR[storage]
        yield (
            f"write_kv {engine}->{storage}",
            _write_kv_kernel,
            {
                "kv_ptr": PTR[engine],
                "pool_ptr": PTR[storage],
                "scales_ptr": scales,
                "slot_ptr": "*i64",
            },
            shape | {"QUANTIZED": quantized},
        )
        yield (
            f"read_kv {storage}->{engine}",
            _read_kv_kernel,
            {
                "pool_ptr": PTR[storage],
                "scales_ptr": scales,
                "slot_ptr": "*i64",
                "out_ptr": PTR[engine],
            },
            shape | {"QUANTIZED": quantized},
        )


def _attention_variants():
    pairs = [("fp16", "fp16"), ("bf16", "int8"), ("fp32", "fp8")]  # (q dtype, KV storage)
    for (q_dtype, storage), group, splits in itertools.product(pairs, [1, 3, 8], [1, 4]):
        group_pad, tile_n = triton.next_power_of_2(group), 8 if group > 1 else 16
        cache = PTR[storage]
        scales = "*fp32" if storage in QUANT else cache
        yield (
            f"paged_decode q={q_dtype} kv={storage} group={group} splits={splits}",
            _paged_decode_kernel,
            {
                "q_ptr": PTR[q_dtype],
                "k_ptr": cache,
                "v_ptr": cache,
                "out_ptr": PTR[q_dtype],
                "k_scale_ptr": scales,
                "v_scale_ptr": scales,
                "bt_ptr": "*i32",
                "seq_lens_ptr": "*i32",
                "part_out_ptr": "*fp32",
                "part_lse_ptr": "*fp32",
                "qk_scale_log2": "fp32",
            },
            dict(
                BLOCK_SIZE=16,
                GROUP=group,
                GROUP_PAD=group_pad,
                HEAD_DIM=128,
                BLOCK_D=128,
                TILE_N=tile_n,
                NUM_SPLITS=splits,
                QUANTIZED=storage in QUANT,
            ),
            _num_warps(group_pad, tile_n, 128),
        )
    for out_dtype in ["fp16", "bf16", "fp32"]:
        yield (
            f"merge_splits {out_dtype}",
            _merge_splits_kernel,
            {
                "part_out_ptr": "*fp32",
                "part_lse_ptr": "*fp32",
                "out_ptr": PTR[out_dtype],
            },
            dict(HEAD_DIM=128, BLOCK_D=128, NUM_SPLITS=5, SPLITS_PAD=8),
        )


def _copy_variants():
    for ptr in ["*u8", "*i16", "*i32"]:
        yield (
            f"copy_blocks {ptr}",
            _copy_blocks_kernel,
            {
                "src_ptr": ptr,
                "dst_ptr": ptr,
                "src_ids_ptr": "*i64",
                "dst_ids_ptr": "*i64",
            },
            dict(CHUNK=4096),
        )


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
        return 2
    failures = []
    for label, kernel, arg_types, constexprs, *warps in itertools.chain(
        _write_read_variants(), _attention_variants(), _copy_variants()
    ):
        try:
            _compile(kernel, arg_types, constexprs, *warps)
        except Exception as error:  # noqa: BLE001 - report every failing variant, not just the first
            failures.append(f"{label}: {type(error).__name__}: {error}")
    for failure in failures:
        print("FAILED", failure)
    print(f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
