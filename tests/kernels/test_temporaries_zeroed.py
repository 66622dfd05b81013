"""The CPU kernels zero every temporary they copy KV into before freeing it: after a write through the scatter path
(a strided slice, as a put of an uncached suffix hands over), a quantized write, a dtype-converting write and the
gathers of reads, a real child process that zeroed its own inputs and its pool holds the KV's bytes nowhere in its
writable memory — glibc keeps freed memory mapped (GLIBC_TUNABLES), so a temporary freed unzeroed would be found."""

from __future__ import annotations

import subprocess
import sys

import torch

from tests.privacy.memory_scan import find_bytes, readable

RETAINING_MALLOC = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296"
SEED = 20261201

CHILD = r"""
import sys, torch
from kernels import reference

torch.manual_seed(SEED)
pattern = torch.randn(16, dtype=torch.float32)  # 64 bytes the parent looks for
shape = (2, 2, 4096, 2, 16)  # [L, 2, T, H, D]: 1 MiB of fp32 KV, every 16 values the pattern
kv = torch.empty(shape, dtype=torch.float32)
kv.view(-1, 16)[:] = pattern
pattern.zero_()
suffix = kv[:, :, 3:]  # strided, starts mid-block: the scatter path reshapes it into a temporary
slots = torch.arange(3, 4096, dtype=torch.int64)
for storage in (torch.float32, torch.float16, torch.int8):
    pool = torch.zeros((1024, 2, 2, 4, 2, 16), dtype=storage)
    scales = torch.ones((1024, 2, 2, 4, 2), dtype=torch.float32) if storage == torch.int8 else None
    reference.write_kv_reference(suffix, pool, scales, slots)
    out = torch.empty((2, 2, len(slots), 2, 16), dtype=torch.float32)
    reference.read_kv_reference(pool, scales, slots, torch.float32, out=out)
    reference.read_kv_reference(pool, scales, slots, torch.float16)
    out.zero_()
    pool.zero_()
    del pool, scales, out
kv.zero_()
del kv, suffix
print("ready", flush=True)
sys.stdin.readline()
""".replace("SEED", str(SEED))


def expected_pattern() -> bytes:
    torch.manual_seed(SEED)
    return torch.randn(16, dtype=torch.float32).numpy().tobytes()


def test_no_temporary_of_a_kernel_keeps_kv_in_freed_memory(tmp_path):
    env = {"GLIBC_TUNABLES": RETAINING_MALLOC, "PYTHONPATH": ".", "PATH": "/usr/bin:/bin"}
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                             text=True)  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "ready"
        # the scan is the proof: a machine where it cannot read the child fails here rather than passing unproven
        assert readable(child.pid), "this process may not read the child's memory (needs root or ptrace)"
        hits = find_bytes(child.pid, expected_pattern())
        assert hits == [], f"KV survives in freed memory at {[hex(h.address) + ' ' + h.region for h in hits[:3]]}"
    finally:
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(30)
