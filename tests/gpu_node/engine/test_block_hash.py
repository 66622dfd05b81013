import hashlib
import os

import numpy as np
import pytest

from gpu_node.engine.block_hash import (
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
    assert _chain_hashes_c(key, parent, data, block_bytes, 16) == chain_hashes_python(
        key, parent, data, block_bytes, 16
    )
    expected, previous = b"", parent
    for i in range(5):
        previous = hashlib.blake2b(previous + data[i * block_bytes : (i + 1) * block_bytes], key=key, digest_size=16)
        previous = previous.digest()
        expected += previous
    assert chain_hashes_python(key, parent, data, block_bytes, 16) == expected


# ---- hashing only as far as a held run goes (lookup's early exit) ---------------------------------------------------
def _held_impls():
    from gpu_node.engine import block_hash

    impls = [block_hash.chain_hashes_held_python]
    assert block_hash._chain_hashes_held_c is not None, "the C extension is not built: `make install` builds it"
    return impls + [block_hash._chain_hashes_held_c]


class _Contains:
    """A container known only by __contains__ (as the lower tiers are), recording what it was asked."""

    def __init__(self, hashes):
        self.hashes, self.asked = set(hashes), []

    def __contains__(self, block_hash):
        self.asked.append(block_hash)
        return block_hash in self.hashes


@pytest.mark.parametrize("stride", [1, 2, 3, 8, 64])
@pytest.mark.parametrize("block_bytes", [64, 112, 128])
def test_held_chain_is_a_prefix_of_the_chain_and_stops_within_a_stride_of_the_first_miss(stride, block_bytes):
    num_blocks = 21
    key, parent, data = os.urandom(32), os.urandom(16), os.urandom(block_bytes * num_blocks + 5)
    full = chain_hashes_python(key, parent, data, block_bytes, 16)
    hashes = [full[i * 16 : (i + 1) * 16] for i in range(num_blocks)]
    for impl in _held_impls():
        for num_held in range(num_blocks + 1):  # prefix closed: the first num_held are held
            for held in (dict.fromkeys(hashes[:num_held], 0), set(hashes[:num_held]), _Contains(hashes[:num_held])):
                digests, found = impl(key, parent, data, block_bytes, 16, held, stride)
                assert found == num_held, (impl, type(held))
                assert full.startswith(digests) and len(digests) % 16 == 0  # byte-identical to hashlib's chain
                computed = len(digests) // 16
                if num_held == num_blocks:
                    assert computed == num_blocks
                else:  # the first missing block is always hashed (a caller continues from it), at most a stride on
                    assert num_held < computed <= min(num_blocks, num_held + stride)


@pytest.mark.parametrize("impl", ["python", "c"])
def test_held_chain_with_stride_one_is_the_leading_run_even_when_held_has_gaps(impl):
    from gpu_node.engine import block_hash

    impl = block_hash.chain_hashes_held_python if impl == "python" else block_hash._chain_hashes_held_c
    key, parent, data = os.urandom(32), os.urandom(16), os.urandom(64 * 10)
    full = chain_hashes_python(key, parent, data, 64, 16)
    hashes = [full[i * 16 : (i + 1) * 16] for i in range(10)]
    held = _Contains(hashes[:4] + hashes[5:])  # block 4 missing, later ones held (not prefix closed)
    digests, found = impl(key, parent, data, 64, 16, held, 1)
    assert found == 4 and digests == full[: 5 * 16]
    assert held.asked == hashes[:5]  # one probe per block, none past the first miss
    assert impl(key, parent, b"", 64, 16, held, 1) == (b"", 0)


@pytest.mark.parametrize("impl", ["python", "c"])
def test_held_chain_refuses_bad_arguments_and_passes_errors_through(impl):
    from gpu_node.engine import block_hash

    impl = block_hash.chain_hashes_held_python if impl == "python" else block_hash._chain_hashes_held_c
    key, parent, data = os.urandom(32), os.urandom(16), os.urandom(64 * 3)
    with pytest.raises(ValueError):
        impl(key, parent, data, 64, 16, set(), 0)

    class Broken:
        def __contains__(self, block_hash):
            raise KeyError("tier failed")

    with pytest.raises(KeyError):
        impl(key, parent, data, 64, 16, Broken(), 1)


def test_held_run_continues_a_chain_and_names_the_same_hashes_as_block_chain():
    hasher = BlockHasher(KEY_A, 4, "m")
    tokens = tokens_as_int32(list(range(4 * 30 + 3)))
    full = hasher.block_chain(tokens)
    index = dict.fromkeys(full.hashes(0, 12), 0)
    chain, found = hasher.held_run(tokens, index, stride=5)
    assert found == 12 and 12 < len(chain) <= 17 and chain.hashes() == full.hashes(0, len(chain))
    assert chain.root == full.root
    lower = set(full.hashes(12, 20))
    more, run = hasher.held_run(tokens, lower, after=chain)  # on from block len(chain), one probe per block
    assert run == 20 - len(chain) and more.hashes() == full.hashes(0, 21)
    done, none = hasher.held_run(tokens, set(full.hashes()), after=full)  # nothing left to hash
    assert none == 0 and done.hashes() == full.hashes()


# ---- token ids from Python lists -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "tokens",
    [[], [0], [2**31 - 1, 0, 5], list(range(1000)), (1, 2, 3), [np.int64(3), 4], [np.int32(7)], [True, 1]],
)
def test_token_lists_convert_exactly_as_numpy_does(tokens):
    expected = np.asarray(tokens, dtype=np.int64).astype("<i4") if len(tokens) else np.zeros(0, "<i4")
    converted = tokens_as_int32(tokens)
    assert converted.dtype == np.dtype("<i4") and converted.flags.c_contiguous
    assert np.array_equal(converted, expected)


@pytest.mark.parametrize(
    "bad", [[-1], [1, 2**31], [2**70], [-(2**70)], [1, 2.0], [True], [[1, 2]], ["1"], [None], [1, -5, 3]]
)
def test_bad_token_lists_are_refused(bad):
    with pytest.raises(ValueError):
        tokens_as_int32(bad)
