import hashlib
import os

import numpy as np
import pytest

from gpu_node.block_hash import (
    HASH_NUM_BYTES,
    BlockHasher,
    _chain_hashes_c,
    chain_hashes_python,
    tokens_as_int32,
)

KEY_A = bytes(range(32))
KEY_B = bytes(range(1, 33))


def test_same_key_same_chain_across_instances():
    tokens = tokens_as_int32(list(range(40)))
    first = BlockHasher(KEY_A, 16, "m").block_hashes(tokens)
    second = BlockHasher(KEY_A, 16, "m").block_hashes(tokens)
    assert first == second  # stable across processes/restarts, unlike Python's hash()
    assert len(first) == 2 and all(len(h) == HASH_NUM_BYTES for h in first)


def test_other_key_shares_no_hash():
    tokens = tokens_as_int32(list(range(64)))
    a = BlockHasher(KEY_A, 16, "m")
    b = BlockHasher(KEY_B, 16, "m")
    assert not set(a.block_hashes(tokens)) & set(b.block_hashes(tokens))
    assert a.root != b.root


def test_fingerprint_changes_the_root_and_every_hash():
    tokens = tokens_as_int32(list(range(32)))
    a = BlockHasher(KEY_A, 16, "llama@rev1")
    b = BlockHasher(KEY_A, 16, "llama@rev2")
    assert not set(a.block_hashes(tokens)) & set(b.block_hashes(tokens))


def test_chain_a_changed_first_block_changes_every_later_hash():
    hasher = BlockHasher(KEY_A, 4, "m")
    base = hasher.block_hashes(tokens_as_int32([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]))
    changed = hasher.block_hashes(tokens_as_int32([1, 2, 3, 99, 5, 6, 7, 8, 9, 10, 11, 12]))
    assert all(x != y for x, y in zip(base, changed))
    moved = hasher.block_hashes(tokens_as_int32([5, 6, 7, 8, 1, 2, 3, 4]))
    assert moved[1] != base[0] and moved[0] != base[1]  # position matters through the chain


def test_partial_tail_is_not_hashed():
    hasher = BlockHasher(KEY_A, 4, "m")
    assert len(hasher.block_hashes(tokens_as_int32([1, 2, 3, 4, 5, 6]))) == 1
    assert hasher.block_hashes(tokens_as_int32([])) == []


@pytest.mark.parametrize("bad", [[-1], [2**31], [[1, 2]], [1.5]])
def test_tokens_outside_int32_ids_are_refused(bad):
    with pytest.raises(ValueError):
        tokens_as_int32(np.asarray(bad))


@pytest.mark.parametrize("key", [b"short", b"x" * 65, "not-bytes"])
def test_weak_or_malformed_keys_are_refused(key):
    with pytest.raises(ValueError):
        BlockHasher(key, 16, "m")


@pytest.mark.parametrize("block_bytes", [4, 64, 112, 128, 4096])
@pytest.mark.parametrize("key_len", [16, 64])
def test_c_chain_is_byte_identical_to_hashlib(block_bytes, key_len):
    assert _chain_hashes_c is not None, "the C extension is not built: `make install` builds it"
    key, parent, data = os.urandom(key_len), os.urandom(16), os.urandom(block_bytes * 5 + 3)
    assert _chain_hashes_c(key, parent, data, block_bytes, 16) == chain_hashes_python(key, parent, data, block_bytes, 16)
    expected, previous = b"", parent
    for i in range(5):
        previous = hashlib.blake2b(previous + data[i * block_bytes : (i + 1) * block_bytes], key=key, digest_size=16)
        previous = previous.digest()
        expected += previous
    assert chain_hashes_python(key, parent, data, block_bytes, 16) == expected
