"""Kernel benchmark: bandwidth of write_kv / read_kv / copy_blocks against a plain dst.copy_(src) of the same bytes,
and paged decode attention against torch SDPA on the same K/V gathered into contiguous tensors.

    python -m bench.kernels [--quick] [--device cpu|cuda]

Layout like Llama-3-8B (32 layers, 8 KV heads, head_dim 128, fp16, block size 16; 32 query heads), sized to fit.
On CUDA the Triton kernels run, on CPU the torch reference (the production CPU path); the table says which.
GB/s counts the KV payload once (bytes of the engine-side tensor), for the kernels and for the memcpy alike.
Every destination is an already-touched buffer, as for the memcpy (reads use read_kv's ``out=``), except
``read_alloc``, which lets read_kv allocate its output each call (on CPU that is mostly page faults).
Prints a table, then one JSON object on the last line.
"""

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from kcaas_kernels import copy_blocks, paged_decode_attention, read_kv, write_kv
from kcaas_kernels.paged_attention import _launch
from kcaas_kernels.reference import paged_decode_attention_reference

NUM_LAYERS, NUM_KV_HEADS, NUM_Q_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 32, 128, 16
DTYPE = torch.float16

# (tokens moved by write/read/copy, attention batch, attention sequence length, timed repetitions)
SIZES = {
    ("cpu", True): (256, 2, 256, 7),
    ("cpu", False): (1024, 4, 1024, 9),
    ("cuda", True): (1024, 8, 1024, 20),
    ("cuda", False): (8192, 32, 2048, 50),
}


def _timer(device: torch.device):
    """Returns measure(fns, reps) -> {name: median ms}. The functions run interleaved (one call of each per round,
    after two warm-up rounds), so a noisy neighbour slows every op alike and the ratios stay meaningful."""

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def measure(fns: dict, reps: int) -> dict:
        samples = {name: [] for name in fns}
        for round_index in range(reps + 2):
            for name, fn in fns.items():
                sync()
                start = time.perf_counter()
                fn()
                sync()
                if round_index >= 2:
                    samples[name].append((time.perf_counter() - start) * 1e3)
        return {name: statistics.median(values) for name, values in samples.items()}

    return measure


def _pool(num_blocks: int, device, dtype=DTYPE):
    pool = torch.zeros((num_blocks, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), dtype=dtype, device=device)
    scales = None
    if dtype in (torch.int8, torch.float8_e4m3fn):
        scales = torch.ones((num_blocks, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS), device=device)
    return pool, scales


def bench_copies(device, num_tokens: int, reps: int, measure) -> dict:
    """write/read/copy of num_tokens tokens in whole blocks (shuffled block ids) vs memcpy of the same bytes."""
    num_blocks = num_tokens // BLOCK_SIZE
    pool, _ = _pool(3 * num_blocks, device)
    kv = torch.randn((NUM_LAYERS, 2, num_tokens, NUM_KV_HEADS, HEAD_DIM), device=device).to(DTYPE)
    blocks = torch.randperm(2 * num_blocks, device=device)[:num_blocks]
    slots = (blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device=device)).flatten()
    scattered = torch.randperm(2 * num_blocks * BLOCK_SIZE, device=device)[:num_tokens]
    copy_dst = torch.arange(2 * num_blocks, 3 * num_blocks, device=device)
    dst = torch.empty_like(kv)
    gigabytes = kv.numel() * kv.element_size() / 1e9
    int8_pool, int8_scales = _pool(3 * num_blocks, device, torch.int8)
    ms = measure(
        {
            "memcpy": lambda: dst.copy_(kv),
            "write": lambda: write_kv(kv, pool, None, slots),
            "read": lambda: read_kv(pool, None, slots, out_dtype=DTYPE, out=dst),
            "read_alloc": lambda: read_kv(pool, None, slots, out_dtype=DTYPE),
            "copy": lambda: copy_blocks(pool, None, pool, None, blocks, copy_dst),
            "write_scattered": lambda: write_kv(kv, pool, None, scattered),
            "read_scattered": lambda: read_kv(pool, None, scattered, out_dtype=DTYPE, out=dst),
            "write_int8": lambda: write_kv(kv, int8_pool, int8_scales, slots),
            "read_int8": lambda: read_kv(int8_pool, int8_scales, slots, out_dtype=DTYPE, out=dst),
        },
        reps,
    )
    return {f"{name}_gbps": gigabytes / (t / 1e3) for name, t in ms.items()} | {"copy_gigabytes": gigabytes}


def bench_attention(device, batch: int, seq_len: int, reps: int, measure) -> dict:
    """Decode attention over layer 0 of a pool vs SDPA on the same K/V gathered contiguously."""
    pages = seq_len // BLOCK_SIZE
    pool, _ = _pool(batch * pages + 1, device)
    pool.normal_()
    block_tables = torch.randperm(batch * pages, device=device).view(batch, pages).to(torch.int32)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
    q = torch.randn((batch, NUM_Q_HEADS, HEAD_DIM), device=device).to(DTYPE)
    gathered = pool[block_tables.long(), 0]  # [B, pages, 2, bs, H, D]
    k, v = (
        gathered[:, :, i].reshape(batch, seq_len, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous() for i in range(2)
    )
    q4 = q[:, :, None, :]
    out = paged_decode_attention(q, pool, None, 0, block_tables, seq_lens)
    expected = F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)[:, :, 0]
    max_err = (out.float() - expected.float()).abs().max().item()
    sm_scale = HEAD_DIM**-0.5
    # The kernels alone, without the wrapper's input checks (which sync with the host once on CUDA).
    unchecked = _launch if device.type == "cuda" else paged_decode_attention_reference
    extra = (seq_len,) if device.type == "cuda" else ()

    def kernel_only():
        return unchecked(q, pool, None, 0, block_tables, seq_lens, sm_scale, *extra)

    ms = measure(
        {
            "attn": lambda: paged_decode_attention(q, pool, None, 0, block_tables, seq_lens),
            "attn_kernel": kernel_only,
            "sdpa": lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True),
        },
        reps,
    )
    attn_ms, sdpa_ms = ms["attn"], ms["sdpa"]
    kv_gigabytes = 2 * k.numel() * k.element_size() / 1e9
    return {
        "attn_ms": attn_ms,
        "sdpa_ms": sdpa_ms,
        "attn_kernel_ms": ms["attn_kernel"],
        "attn_vs_sdpa": sdpa_ms / attn_ms,
        "attn_gbps": kv_gigabytes / (attn_ms / 1e3),
        "attn_max_abs_err_vs_sdpa": max_err,
    }


def _print_table(result: dict) -> None:
    print(f"device {result['device']}  impl {result['impl']}  ({result['layout']})")
    print(f"{'op':<18}{'GB/s':>10}{'x memcpy':>10}")
    for op in (
        "memcpy",
        "write",
        "read",
        "read_alloc",
        "copy",
        "write_scattered",
        "read_scattered",
        "write_int8",
        "read_int8",
    ):
        gbps = result[f"{op}_gbps"]
        print(f"{op:<18}{gbps:>10.2f}{gbps / result['memcpy_gbps']:>10.2f}")
    print(
        f"{'paged attention':<18}{result['attn_ms']:>9.3f} ms   ({result['attn_gbps']:.1f} GB/s of K/V; "
        f"{result['attn_kernel_ms']:.3f} ms without input checks)"
    )
    print(f"{'sdpa (gathered)':<18}{result['sdpa_ms']:>9.3f} ms   sdpa/attn = {result['attn_vs_sdpa']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (under a minute on 2 CPU cores)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    num_tokens, batch, seq_len, reps = SIZES[(device.type, args.quick)]
    measure = _timer(device)
    torch.manual_seed(0)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{torch.get_num_threads()}",
        "impl": "triton" if device.type == "cuda" else "reference",
        "layout": f"L{NUM_LAYERS} Hkv{NUM_KV_HEADS} Hq{NUM_Q_HEADS} D{HEAD_DIM} bs{BLOCK_SIZE} fp16; "
        f"{num_tokens} tokens moved; attention B{batch} x {seq_len}",
        "quick": args.quick,
    }
    result |= bench_copies(device, num_tokens, reps, measure)
    result |= bench_attention(device, batch, seq_len, reps, measure)
    for op in ("write", "read", "copy"):
        result[f"{op}_vs_memcpy"] = result[f"{op}_gbps"] / result["memcpy_gbps"]
    _print_table(result)
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in result.items()}))


if __name__ == "__main__":
    main()
