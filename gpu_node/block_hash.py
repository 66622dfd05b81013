"""Keyed, chained block hashes: the names of full blocks in a cache's prefix index.

    h_0 = root = BLAKE2b_key("kcaas/root/v1" || model fingerprint digest)
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
small. A keyed hasher is created once per cache and `.copy()`-ed per block so the key block is not recompressed.
"""

from __future__ import annotations

import hashlib
from typing import NewType

import numpy as np

BlockHash = NewType("BlockHash", bytes)

HASH_NUM_BYTES = 16
MIN_KEY_BYTES = 16
MAX_KEY_BYTES = 64  # BLAKE2b's key limit
MAX_TOKEN_ID = 2**31 - 1


def tokens_as_int32(tokens) -> np.ndarray:
    """Token ids as a contiguous little-endian int32 array; refuses ids outside [0, 2**31)."""
    array = np.asarray(tokens.cpu() if hasattr(tokens, "cpu") else tokens)
    if array.ndim != 1:
        raise ValueError(f"tokens must be a 1-D sequence of token ids, got shape {array.shape}")
    if array.size and array.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {array.dtype}")
    if array.size and (int(array.min()) < 0 or int(array.max()) > MAX_TOKEN_ID):
        raise ValueError(f"token ids must lie in [0, {MAX_TOKEN_ID}]")
    return np.ascontiguousarray(array, dtype="<i4")


class BlockHasher:
    """Computes the chain of block hashes for token sequences under one cache's secret key."""

    def __init__(self, key: bytes, block_size: int, model_fingerprint: str):
        if not isinstance(key, bytes) or not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"hash key must be {MIN_KEY_BYTES}..{MAX_KEY_BYTES} secret bytes")
        self.block_size = block_size
        self._keyed = hashlib.blake2b(key=key, digest_size=HASH_NUM_BYTES)
        fingerprint_digest = hashlib.sha256(model_fingerprint.encode()).digest()
        self.root = self._hash(b"kcaas/root/v1", fingerprint_digest)

    def _hash(self, parent: bytes, token_bytes) -> BlockHash:
        hasher = self._keyed.copy()
        hasher.update(parent)
        hasher.update(token_bytes)
        return BlockHash(hasher.digest())

    def iter_block_hashes(self, tokens: np.ndarray, parent: BlockHash | None = None):
        """Yield h_i for each full block of `tokens` (int32), lazily so lookups stop at the first miss."""
        data = memoryview(tokens.view(np.uint8))
        step = self.block_size * 4
        parent = self.root if parent is None else parent
        keyed_copy = self._keyed.copy
        for start in range(0, (len(tokens) // self.block_size) * step, step):
            hasher = keyed_copy()
            hasher.update(parent)
            hasher.update(data[start : start + step])
            parent = hasher.digest()
            yield parent

    def block_hashes(self, tokens: np.ndarray) -> list[BlockHash]:
        return list(self.iter_block_hashes(tokens))
