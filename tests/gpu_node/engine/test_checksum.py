"""gpu_node.engine.checksum: xxh3-64 over a block's parts, equal to hashing their concatenation; any flipped byte
fails."""

import numpy as np
import xxhash

from gpu_node.engine.checksum import block_checksum, verify_block


def test_parts_hash_like_their_concatenation_and_a_flipped_byte_fails():
    pool = np.arange(4096, dtype=np.float16)
    scales = np.linspace(0.1, 2.0, 64, dtype=np.float32)
    value = block_checksum(memoryview(pool), scales)
    assert value == xxhash.xxh3_64(pool.tobytes() + scales.tobytes()).intdigest()
    assert verify_block(value, pool.tobytes(), scales.tobytes())
    damaged = bytearray(pool.tobytes())
    damaged[1234] ^= 0x01
    assert not verify_block(value, bytes(damaged), scales.tobytes())
