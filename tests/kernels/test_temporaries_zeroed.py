"""The CPU kernels zero every temporary they copy KV into before freeing it: after a write through the scatter path
(a strided slice, as a put of an uncached suffix hands over), a quantized write, a dtype-converting write and the
gathers of reads, a real child process per storage dtype that zeroed its own inputs (and, last, its pool) holds the
KV's bytes nowhere in its writable memory — glibc keeps freed memory mapped (GLIBC_TUNABLES), so a temporary freed
unzeroed would be found."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.privacy.memory_scan import find_bytes, readable

RETAINING_MALLOC = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296"
SEED = 20261201

# One child per storage dtype, scanned after the write and again after the reads: a child that did everything
# before one scan let later allocations of the same size (the reads' outputs, zeroed) reuse a temporary freed
# unzeroed and hide it, so the leak was found only sometimes.
CHILD = r"""
import sys, torch
from kcaas_kernels import reference

torch.manual_seed(SEED)
pattern = torch.randn(16, dtype=torch.float32)  # 64 bytes the parent looks for
shape = (2, 2, 4096, 2, 16)  # [L, 2, T, H, D]: 1 MiB of fp32 KV, every 16 values the pattern
kv = torch.empty(shape, dtype=torch.float32)
kv.view(-1, 16)[:] = pattern
pattern.zero_()
suffix = kv[:, :, 3:]  # strided, starts mid-block: the scatter path and quantization reshape it into temporaries
slots = torch.arange(3, 4096, dtype=torch.int64)
storage = getattr(torch, sys.argv[1])
pool = torch.zeros((1024, 2, 2, 4, 2, 16), dtype=storage)
quantized = storage in (torch.int8, torch.float8_e4m3fn)
scales = torch.ones((1024, 2, 2, 4, 2), dtype=torch.float32) if quantized else None
reference.write_kv_reference(suffix, pool, scales, slots)
kv.zero_()
print("written", pool.data_ptr(), pool.nbytes, flush=True)  # the pool holds the KV: where the scan looks past
sys.stdin.readline()
out = torch.empty((2, 2, len(slots), 2, 16), dtype=torch.float32)
reference.read_kv_reference(pool, scales, slots, torch.float32, out=out)
out.zero_()
reference.read_kv_reference(pool, scales, slots, torch.float16).zero_()
pool.zero_()
print("read 0 0", flush=True)
sys.stdin.readline()
""".replace("SEED", str(SEED))


def expected_pattern() -> bytes:
    torch.manual_seed(SEED)
    return torch.randn(16, dtype=torch.float32).numpy().tobytes()


@pytest.mark.parametrize("storage", ["float32", "float16", "int8", "float8_e4m3fn"])
def test_no_temporary_of_a_kernel_keeps_kv_in_freed_memory(storage):
    env = {"GLIBC_TUNABLES": RETAINING_MALLOC, "PYTHONPATH": ".", "PATH": "/usr/bin:/bin"}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, storage], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        for stage in ("written", "read"):
            said, pool_at, pool_bytes = child.stdout.readline().split()
            assert said == stage
            # the scan is the proof: a machine where it cannot read the child fails here rather than passing unproven
            assert readable(child.pid), "this process may not read the child's memory (needs root or ptrace)"
            in_pool = range(int(pool_at), int(pool_at) + int(pool_bytes))
            hits = [h for h in find_bytes(child.pid, expected_pattern(), limit=1 << 20) if h.address not in in_pool]
            assert hits == [], f"KV survives {stage} at {[hex(h.address) + ' ' + h.region for h in hits[:3]]}"
            child.stdin.write("\n")
            child.stdin.flush()
    finally:
        child.stdin.close()  # its last readline ends: it exits
        child.wait(30)
