"""The node process's malloc settings for KV-block-sized buffers.

Every block a lower tier hands back (a network or SSD read, a DRAM take) is a fresh bytearray of one block's payload
(2 MiB for a Llama-3-8B-like layout), owned by the caller, zeroed, then freed. glibc serves such a request from a
fresh mmap once the heap top was trimmed, and then every one of its 512 pages faults on first touch, which costs
several times the copy itself (bench.tiers' network rows measure a block's read; docs/performance.md). So the
agent keeps buffers up to MMAP_THRESHOLD on the heap and trims the heap only past TRIM_THRESHOLD.

Erasure is unaffected: every payload copy is zeroed before it is let go (docs/ARCHITECTURE.md, the purge fence), so
heap memory kept for reuse holds zeros, not KV (tests/privacy/test_erasure_agent_memory.py searches the agent's
memory for an erased tenant's KV).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD = 8 << 20  # above a block's payload and record (2 MiB + a header), below the pools and staging
TRIM_THRESHOLD = 256 << 20


def keep_block_buffers_on_heap(environ=os.environ) -> bool:
    """Apply the settings (glibc on Linux; elsewhere nothing). True when applied. Malloc tunables the operator set
    (GLIBC_TUNABLES glibc.malloc.*) win: nothing is changed then."""
    if not sys.platform.startswith("linux") or "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
            libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        )
    except (OSError, AttributeError):  # not glibc (musl has no mallopt): its own allocator's defaults stand
        return False
