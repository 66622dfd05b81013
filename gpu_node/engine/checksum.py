"""The one block checksum of the node: xxh3-64 over a block's stored bytes (pool bytes, then scales when the storage
is quantized). Computed when a block goes to a lower tier or onto the wire; verified when it comes back, is read
from SSD, or arrives from another node. A mismatch is a miss, never wrong KV.

One part is hashed in one call (no state on the heap). Several parts go through a streaming state, which buffers
the last input bytes (up to 256) in heap memory it frees without zeroing: it is fed zeros before it is let go, so
no KV is left behind in freed memory (the digest is taken first, so the zeros do not change it)."""

from __future__ import annotations

import xxhash

_SCRUB = bytes(512)  # more than the streaming state's input buffer


def block_checksum(*parts) -> int:
    """xxh3-64 of the concatenation of `parts` (buffers: memoryview, bytes, numpy arrays), without joining them."""
    if len(parts) == 1:
        return xxhash.xxh3_64_intdigest(parts[0])
    digest = xxhash.xxh3_64()
    for part in parts:
        digest.update(part)
    value = digest.intdigest()
    digest.update(_SCRUB)
    return value


def verify_block(expected: int, *parts) -> bool:
    return block_checksum(*parts) == int(expected)
