"""Keyed, chained block hashes: the names of full blocks in a cache's prefix index.

    h_0 = root = BLAKE2b_key("kcaas/root/v<LAYOUT_VERSION>" || model fingerprint digest)
    h_i = BLAKE2b_key(h_{i-1} || int32 little-endian bytes of the block_size tokens of block i)

Why chained: a block's KV depends on every token before it, so its name must too; equal hashes mean equal prefixes.

Why keyed (a per-cache secret, 16-64 bytes, an argument of the cache delivered by the control plane at
provisioning — never derived from request data, never sent by a client):
- isolation by construction: two tenants (or two caches of one tenant) that store the same prompt get unrelated
  hashes, so no index, log line or timing of one can confirm the other holds a prefix. A client-chosen salt (vLLM's
  cache_salt) would let an attacker send the victim's salt;
- collision resistance against adversarial inputs: without the key an attacker cannot search for two token
  sequences with the same 128-bit name (which would serve one tenant's KV for another prompt).

Why not Python's `hash`: it is randomised per process (PYTHONHASHSEED), so names would not survive a restart or
cross to another node (warm restart, migration), it is 64 bits and not collision resistant, and tuples of ints hash
with a public, invertible function that is easy to collide on purpose.

Why BLAKE2b: keyed mode is built in (a MAC, not an ad hoc salt), it is in hashlib, and it is faster per byte than
SHA-256 in CPython. Digests are 16 bytes: with a secret key, 128 bits leaves forging out of reach and keeps the index
small.

Speed: the chain is computed in C (gpu_node/engine/_blockhash.c, BLAKE2b from RFC 7693, byte-identical to hashlib's
keyed blake2b) in one call per sequence, several times cheaper than four Python-level hashlib calls per block
(bench.engine's lookup_* figures measure it). A lookup needs only the cached part of a chain: `BlockHasher.held_run` (C
`chain_hashes_held`) hashes block by block, probes a container every few blocks (the device index; the lower tiers after
it) and stops at the first block it lacks, so a prompt whose first half is cached costs about half a fully cached one.
Token ids given as a Python list are converted in C (numpy's conversion cost more than hashing them), and an int32
array's one check (no negative id) is a C pass. Without the extension the same chains come from hashlib
(`chain_hashes_python`, `chain_hashes_held_python`) and the checks from numpy.
"""

from __future__ import annotations

import hashlib
from typing import NewType

import numpy as np

try:
    from gpu_node.engine._blockhash import chain_hashes as _chain_hashes_c
    from gpu_node.engine._blockhash import chain_hashes_held as _chain_hashes_held_c
    from gpu_node.engine._blockhash import int32_nonnegative as _int32_nonnegative_c
    from gpu_node.engine._blockhash import int32_tokens as _int32_tokens_c
except ImportError:  # not built (e.g. a source checkout without `pip install -e .`): hashlib does the same
    _chain_hashes_c = _chain_hashes_held_c = _int32_tokens_c = _int32_nonnegative_c = None

# A block's name: a distinct type, so a raw byte string (a key, a digest, a token buffer) passed where a block's
# name belongs is a type error. Wrap bytes from outside (the wire, an SSD record) with BlockHash(bytes(...)).
BlockHash = NewType("BlockHash", bytes)
# What a lower tier keeps beside a full block so its chain can be rebuilt without the device: (parent, its tokens).
BlockLineage = tuple[BlockHash, np.ndarray]
# What a tier's store pushes out to stay within capacity, for the next tier: (name, payload, checksum).
PushedOut = tuple[BlockHash, bytearray, int]

HASH_NUM_BYTES = 16
MIN_KEY_BYTES = 16
MAX_KEY_BYTES = 64  # BLAKE2b's key limit
MAX_TOKEN_ID = 2**31 - 1
_INT32_LE = np.dtype("<i4")


def tokens_as_int32(tokens) -> np.ndarray:
    """Token ids as a contiguous little-endian int32 array; refuses ids outside [0, 2**31).

    Fast paths, same answers: a list or tuple of plain ints is converted in C (numpy's conversion of a Python list
    costs more than hashing it); an int32 array needs only its sign bits checked (no int32 exceeds 2**31 - 1), in C
    when built (numpy's min() has a fixed overhead larger than the C pass).
    """
    if type(tokens) is np.ndarray and tokens.ndim == 1 and tokens.dtype == _INT32_LE:
        tokens = np.ascontiguousarray(tokens)
        if not (_int32_nonnegative_c(tokens) if _int32_nonnegative_c is not None else tokens.min(initial=0) >= 0):
            raise ValueError(f"token ids must lie in [0, {MAX_TOKEN_ID}]")
        return tokens
    if _int32_tokens_c is not None and type(tokens) in (list, tuple):
        converted = np.empty(len(tokens), dtype=_INT32_LE)
        if _int32_tokens_c(tokens, converted):
            return converted
    array = np.asarray(tokens.cpu() if hasattr(tokens, "cpu") else tokens)
    if array.ndim != 1:
        raise ValueError(f"tokens must be a 1-D sequence of token ids, got shape {array.shape}")
    if array.size and array.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {array.dtype}")
    if array.size and (int(array.min()) < 0 or int(array.max()) > MAX_TOKEN_ID):
        raise ValueError(f"token ids must lie in [0, {MAX_TOKEN_ID}]")
    return np.ascontiguousarray(array, dtype="<i4")


def _bytes_view(data: bytes | np.ndarray) -> memoryview:
    """The bytes of `data` without a copy (an int32 token array's memory, or a bytes object)."""
    return data.data.cast("B") if isinstance(data, np.ndarray) else memoryview(data)


def chain_hashes_python(
    key: bytes, parent: bytes, data: bytes | np.ndarray, block_bytes: int, digest_size: int
) -> bytes:
    """The reference chain (and the fallback): h_i = BLAKE2b_key(h_{i-1} || block i), concatenated."""
    keyed = hashlib.blake2b(key=key, digest_size=digest_size)
    out = bytearray()
    view = _bytes_view(data)
    for start in range(0, (len(data) // block_bytes) * block_bytes, block_bytes):
        hasher = keyed.copy()
        hasher.update(parent)
        hasher.update(view[start : start + block_bytes])
        parent = hasher.digest()
        out += parent
    return bytes(out)


chain_hashes = _chain_hashes_c or chain_hashes_python


def chain_hashes_held_python(
    key: bytes, parent: bytes, data: bytes | np.ndarray, block_bytes: int, digest_size: int, held, stride: int
) -> tuple[bytes, int]:
    """The chain of `data`'s full blocks computed only as far as `held` holds it (the reference for the C version,
    and the fallback): (the digests computed, concatenated; how many leading blocks `held` holds).

    Blocks are hashed in order and every `stride`-th one (and the last) is probed (`h in held`); at the first probe
    that misses, a binary search over that stride's blocks finds the first block `held` lacks, and hashing stops
    there. So the digests cover at least the held run and the first missing block (a caller can continue from it),
    at most stride - 1 blocks more. With stride > 1 the answer is right only when presence along the chain is
    monotone (`held` prefix closed: a held block's parent is held, as the device index is); with stride 1 every
    block is probed and the answer is the leading run whatever `held` holds.
    """
    if stride < 1 or not 1 <= digest_size <= 64 or len(parent) != digest_size or block_bytes < 1:
        raise ValueError("chain_hashes_held: bad key, digest size, parent, block size or stride")
    keyed = hashlib.blake2b(key=key, digest_size=digest_size)
    view = _bytes_view(data)
    num_blocks = len(view) // block_bytes
    digests: list[bytes] = []
    num_held = 0
    while len(digests) < num_blocks:
        end = min(num_blocks, len(digests) + stride)
        while len(digests) < end:
            start = len(digests) * block_bytes
            hasher = keyed.copy()
            hasher.update(parent)
            hasher.update(view[start : start + block_bytes])
            parent = hasher.digest()
            digests.append(parent)
        if digests[end - 1] in held:
            num_held = end
            continue
        missing = end - 1
        while num_held < missing:
            middle = (num_held + missing) // 2
            if digests[middle] in held:
                num_held = middle + 1
            else:
                missing = middle
        break
    return b"".join(digests), num_held


chain_hashes_held = _chain_hashes_held_c or chain_hashes_held_python

# The version of what a block's bytes mean, part of every block's name: a change to the canonical layout (what
# connectors store as [layers, 2, tokens, kv_heads, head_dim]) bumps it, so every block stored under an earlier
# version is a miss on every tier and node, never bytes read with the new meaning (docs/vllm.md, "Layouts", says what
# version 2 changed).
LAYOUT_VERSION = 2
ROOT_PREFIX = f"kcaas/root/v{LAYOUT_VERSION}".encode()


class BlockHasher:
    """Computes the chain of block hashes for token sequences under one cache's secret key."""

    def __init__(self, key: bytes, block_size: int, model_fingerprint: str):
        if not isinstance(key, bytes) or not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"hash key must be {MIN_KEY_BYTES}..{MAX_KEY_BYTES} secret bytes")
        self.block_size = block_size
        self._key = key
        fingerprint_digest = hashlib.sha256(model_fingerprint.encode()).digest()
        keyed = hashlib.blake2b(ROOT_PREFIX + fingerprint_digest, key=key, digest_size=HASH_NUM_BYTES)
        self.root = BlockHash(keyed.digest())

    def chain(self, tokens: np.ndarray) -> bytes:
        """h_1 .. h_n of the full blocks of `tokens` (int32), concatenated: HASH_NUM_BYTES bytes each."""
        return chain_hashes(self._key, self.root, tokens.view(np.uint8), self.block_size * 4, HASH_NUM_BYTES)

    def block_chain(self, tokens: np.ndarray) -> BlockChain:
        """The chain of `tokens` (int32) as a BlockChain: computed once, then indexed (never sliced by hand)."""
        return BlockChain(self.root, self.chain(tokens))

    def chained_hash(self, parent: bytes, tokens: np.ndarray) -> BlockHash:
        """h = BLAKE2b_key(parent || the block_size tokens of one full block): one link of a chain."""
        data = np.ascontiguousarray(tokens, dtype="<i4").view(np.uint8)
        return BlockHash(chain_hashes(self._key, bytes(parent), data.tobytes(), self.block_size * 4, HASH_NUM_BYTES))

    def block_hashes(self, tokens: np.ndarray) -> list[BlockHash]:
        return self.block_chain(tokens).hashes()

    def held_run(self, tokens: np.ndarray, held, *, stride: int = 1, after: BlockChain | None = None):
        """Hash the full blocks of `tokens` (int32) only while `held` (any container of hashes) holds them: returns
        (the chain through every block hashed, how many of the newly hashed blocks are held — a leading run).

        Starts at block 0 under the root, or, given `after` (a chain of these tokens computed so far), at block
        len(after) under after.last(): the result then begins with after's hashes. Hashing stops at the first block
        `held` lacks — hashed too, so a caller can continue from it — or, with stride > 1, at most stride - 1 blocks
        past it: then only every stride-th block is probed, which is right only when `held` is prefix closed along
        the chain (a held block's parent is held, as the device index is). See chain_hashes_held_python.
        """
        first = len(after) if after is not None else 0
        data = tokens[first * self.block_size :] if first else tokens  # contiguous int32: its bytes, not copied
        last = after.last() if after is not None and first else None
        parent = last if last is not None else self.root
        block_bytes = self.block_size * 4
        digests, num_held = chain_hashes_held(self._key, parent, data, block_bytes, HASH_NUM_BYTES, held, stride)
        return BlockChain(self.root, after._digests + digests if after is not None and first else digests), num_held


class BlockChain:
    """The chained hashes h_1 .. h_n of one token sequence's full blocks, under one cache's key.

    Built once per engine call (BlockHasher.block_chain; lookup's BlockHasher.held_run stops where the cache's run
    ends, so its chain may name only the first blocks) and passed down, so no caller hashes a sequence twice or
    slices the concatenated digests by hand. Position i (0-based) names block i, whose parent is position i-1 (the
    root for block 0). Immutable.
    """

    __slots__ = ("root", "_digests", "_num_blocks")

    def __init__(self, root: bytes, digests: bytes):
        assert len(digests) % HASH_NUM_BYTES == 0, "a chain is whole digests"
        self.root = BlockHash(bytes(root))
        self._digests = digests
        self._num_blocks = len(digests) // HASH_NUM_BYTES

    def __len__(self) -> int:
        return self._num_blocks

    def __getitem__(self, position: int) -> BlockHash:
        if not 0 <= position < self._num_blocks:
            raise IndexError(f"block {position} of a chain of {self._num_blocks}")
        return BlockHash(self._digests[position * HASH_NUM_BYTES : (position + 1) * HASH_NUM_BYTES])

    def parent(self, position: int) -> BlockHash:
        """The hash block `position` continues: the root for block 0."""
        return self[position - 1] if position else self.root

    def last(self) -> BlockHash | None:
        return self[self._num_blocks - 1] if self._num_blocks else None

    def hashes(self, start: int = 0, stop: int | None = None) -> list[BlockHash]:
        """Hashes of blocks [start, stop) in order."""
        stop = self._num_blocks if stop is None else min(stop, self._num_blocks)
        return [self[i] for i in range(start, stop)]
