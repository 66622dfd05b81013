"""The one block checksum of the node: xxh3-64 over a block's stored bytes (pool bytes, then scales when the storage
is quantized). Computed when a block goes to a lower tier or onto the wire; verified when it comes back, is read
from SSD, or arrives from another node. A mismatch is a miss, never wrong KV."""

from __future__ import annotations

import xxhash


def block_checksum(*parts) -> int:
    """xxh3-64 of the concatenation of `parts` (buffers: memoryview, bytes, numpy arrays), without joining them."""
    digest = xxhash.xxh3_64()
    for part in parts:
        digest.update(part)
    return digest.intdigest()


def verify_block(expected: int, *parts) -> bool:
    return block_checksum(*parts) == int(expected)
