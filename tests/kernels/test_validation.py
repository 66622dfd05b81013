"""The wrappers refuse bad inputs with ValueError before any kernel runs; dispatch picks the documented impl."""

import importlib
import subprocess
import sys

import pytest
import torch

from kcaas_kernels import HAS_TRITON, copy_blocks, paged_decode_attention, read_kv, write_kv
from kcaas_kernels._common import resolve_impl
from tests.kernels.helpers import make_pool

NB, L, BS, H, D = 3, 2, 4, 2, 8  # 12 slots


def _pool(dtype=torch.float16):
    return make_pool(NB, L, BS, H, D, dtype, "cpu")


def _kv(num_tokens=2, dtype=torch.float16):
    return torch.randn(L, 2, num_tokens, H, D).to(dtype)


SLOTS = torch.tensor([0, 5])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kv=_kv(dtype=torch.float64)), "kv dtype"),
        (dict(kv=torch.randn(L, 2, 2, H + 1, D)), "kv must have shape"),
        (dict(kv=torch.randn(L, 2, 2, H, D)[None]), "kv must have shape"),
        (dict(slot_mapping=torch.tensor([0, 12])), r"slot_mapping values must lie in \[-1, 12\)"),
        (dict(slot_mapping=torch.tensor([-2, 0])), "slot_mapping values"),
        (dict(slot_mapping=torch.tensor([0, 5], dtype=torch.int32)), "slot_mapping must be a 1-D torch.int64"),
        (dict(slot_mapping=torch.tensor([0, 5, 6])), "3 entries for 2 tokens"),
        (dict(scales=torch.ones(NB, L, 2, BS, H)), "not quantized: scales must be None"),
        (dict(pool=_pool()[0].transpose(0, 1)), "contiguous"),
        (dict(pool=_pool()[0].to(torch.float64)), "pool dtype"),
        (dict(impl="cuda"), "impl must be one of"),
    ],
)
def test_write_kv_rejects(kwargs, message):
    args = dict(kv=_kv(), pool=_pool()[0], scales=None, slot_mapping=SLOTS) | kwargs
    impl = args.pop("impl", None)
    with pytest.raises(ValueError, match=message):
        write_kv(args["kv"], args["pool"], args["scales"], args["slot_mapping"], impl=impl)


@pytest.mark.parametrize(
    "scales, message",
    [
        (None, "scales tensor is required"),
        (torch.ones(NB, L, 2, BS, H, dtype=torch.float16), "scales must be float32 of shape"),
        (torch.ones(NB, L, 2, BS, H + 1), "scales must be float32 of shape"),
    ],
)
def test_quantized_pool_needs_matching_scales(scales, message):
    pool, _ = _pool(torch.int8)
    with pytest.raises(ValueError, match=message):
        write_kv(_kv(), pool, scales, SLOTS)
    with pytest.raises(ValueError, match=message):
        read_kv(pool, scales, SLOTS, out_dtype=torch.float16)


def test_read_kv_rejects():
    pool, _ = _pool()
    with pytest.raises(ValueError, match="out_dtype"):
        read_kv(pool, None, SLOTS, out_dtype=torch.int8)
    with pytest.raises(ValueError, match="slot_mapping values"):
        read_kv(pool, None, torch.tensor([12]), out_dtype=torch.float16)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        read_kv(pool, None, [0, 1], out_dtype=torch.float16)
    with pytest.raises(ValueError, match="out must be a torch.float16 tensor of shape"):
        read_kv(pool, None, SLOTS, out_dtype=torch.float16, out=torch.empty(L, 2, 2, H, D))
    with pytest.raises(ValueError, match="out must be contiguous"):
        read_kv(pool, None, SLOTS, out_dtype=torch.float16, out=torch.empty(L, 2, H, 2, D).half().transpose(2, 3))


@pytest.mark.parametrize(
    "src_ids, dst_ids, message",
    [
        ([0, 1], [2], "differ in length"),
        ([0], [3], r"dst_ids values must lie in \[0, 3\)"),
        ([-1], [2], "src_ids values"),
        ([0, 1], [2, 2], "distinct"),
        ([0, 1], [1, 2], "both a source and a destination"),
        (torch.tensor([0.0]), [1], "int32/int64"),
    ],
)
def test_copy_blocks_rejects_ids(src_ids, dst_ids, message):
    pool, _ = _pool()
    with pytest.raises(ValueError, match=message):
        copy_blocks(pool, None, pool, None, src_ids, dst_ids)


def test_copy_blocks_rejects_mismatched_pools():
    pool, _ = _pool()
    other, _ = make_pool(NB, L, BS, H, D + 8, torch.float16, "cpu")
    with pytest.raises(ValueError, match="differ in block shape or dtype"):
        copy_blocks(pool, None, other, None, [0], [0])
    with pytest.raises(ValueError, match="differ in block shape or dtype"):
        copy_blocks(pool, None, pool.to(torch.bfloat16), None, [0], [0])


def _attention_args(**overrides):
    pool, _ = _pool()
    args = dict(
        q=torch.randn(2, 4, D).half(),
        pool=pool,
        scales=None,
        layer=1,
        block_tables=torch.tensor([[2, -1], [0, 1]], dtype=torch.int32),
        seq_lens=torch.tensor([3, 8], dtype=torch.int32),
    )
    return args | overrides


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(q=torch.randn(2, 3, D).half()), "not a multiple of num_kv_heads"),
        (dict(q=torch.randn(2, 4, D + 1).half()), "head_dim"),
        (dict(q=torch.randn(2, 4, D).long()), "q dtype"),
        (dict(layer=2), r"layer must be an int in \[0, 2\)"),
        (dict(block_tables=torch.tensor([[2, -1], [0, 1]])), "block_tables must be a 2-D torch.int32"),
        (dict(seq_lens=torch.tensor([0, 8], dtype=torch.int32)), r"seq_lens must lie in \[1, 8\]"),
        (dict(seq_lens=torch.tensor([3, 9], dtype=torch.int32)), "seq_lens must lie"),
        (dict(seq_lens=torch.tensor([5, 8], dtype=torch.int32)), r"entries in use must lie in \[0, 3\)"),
        (dict(block_tables=torch.tensor([[2, -1], [0, 3]], dtype=torch.int32)), "entries in use"),
        (dict(seq_lens=torch.tensor([3], dtype=torch.int32)), "batch mismatch"),
    ],
)
def test_paged_attention_rejects(overrides, message):
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**_attention_args(**overrides))


def test_unused_block_table_entries_are_not_validated():
    """Entries past a sequence's last page may hold anything (here -1 and a huge id)."""
    args = _attention_args(block_tables=torch.tensor([[2, 10**6], [0, 1]], dtype=torch.int32))
    assert paged_decode_attention(**args).shape == (2, 4, D)


def test_dispatch_picks_reference_on_cpu(monkeypatch):
    def no_triton(*args, **kwargs):
        raise AssertionError("the Triton launcher must not run for CPU tensors with impl=None")

    # kcaas_kernels.write_kv is the function (re-exported by the package); the module lives in sys.modules.
    monkeypatch.setattr(importlib.import_module("kcaas_kernels.write_kv"), "_launch", no_triton)
    pool, _ = _pool()
    write_kv(_kv(), pool, None, SLOTS)
    assert torch.equal(read_kv(pool, None, SLOTS, out_dtype=torch.float16), _kv_written(pool))


def _kv_written(pool):
    return torch.stack([pool[0, :, :, 0], pool[1, :, :, 1]], dim=2)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_triton_on_cpu_needs_the_interpreter():
    def compiled_kernel():  # not an InterpretedFunction: what a kernel is without TRITON_INTERPRET=1
        pass

    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_impl("triton", torch.device("cpu"), compiled_kernel)
    assert resolve_impl(None, torch.device("cpu"), compiled_kernel) == "reference"
    assert resolve_impl(None, torch.device("cuda"), compiled_kernel) == "triton"


def test_kernels_import_and_run_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, kcaas_kernels\n"
        "assert not kcaas_kernels.HAS_TRITON\n"
        "pool = torch.zeros(2, 1, 2, 4, 1, 8)\n"
        "kcaas_kernels.write_kv(torch.ones(1, 2, 3, 1, 8), pool, None, torch.tensor([0, 1, 6]))\n"
        "assert kcaas_kernels.read_kv(pool, None, torch.tensor([6]), out_dtype=torch.float32).sum() == 16\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
