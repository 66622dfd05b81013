"""The agent's malloc settings apply on glibc, and block-sized buffers are then served from the heap, not from a
fresh mapping each (whose every page faults on first touch)."""

import subprocess
import sys

import pytest

from gpu_node.tiers.host_memory import MMAP_THRESHOLD

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and mallinfo2")

MAPPED_BYTES_AFTER_8_BLOCKS = """
import ctypes, ctypes.util, sys
from gpu_node.tiers.host_memory import keep_block_buffers_on_heap
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
        ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = Info
if sys.argv[1] == "on":
    assert keep_block_buffers_on_heap()
before = libc.mallinfo2().hblkhd
buffers = [bytearray(2 << 20) for _ in range(8)]
print(libc.mallinfo2().hblkhd - before)
"""


def mapped_bytes(setting: str) -> int:
    """Bytes glibc holds in mmap'd chunks after 8 block-sized allocations, in a fresh interpreter."""
    run = subprocess.run(
        [sys.executable, "-c", MAPPED_BYTES_AFTER_8_BLOCKS, setting], capture_output=True, text=True, check=True
    )
    return int(run.stdout)


def test_block_sized_buffers_come_from_the_heap_with_the_agents_settings():
    assert (2 << 20) < MMAP_THRESHOLD
    assert mapped_bytes("off") >= 8 * (2 << 20)  # glibc's default: one mapping per buffer
    assert mapped_bytes("on") == 0
