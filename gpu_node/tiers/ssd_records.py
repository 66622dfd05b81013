"""The record format of the SSD tier's segment files (gpu_node/tiers/ssd_store.py): encoding and verified decoding.

Record = HEADER (magic, payload ciphertext length, block hash, nonce, xxh3-64 of the plaintext payload, parent hash,
number of tokens, tokens nonce) + AES-GCM(data key, nonce, payload, aad = AAD_PREFIX + "kv" + block hash + parent
hash + number of tokens) + AES-GCM(data key, tokens nonce, int32 tokens, aad = the same with "tk"), each 16 bytes
longer than its plaintext (no tokens part without lineage: 0 tokens, a zero parent). Two messages, so the payload is
encrypted straight from its buffer (no copy to join it with the tokens). The associated data binds a record to its
name and lineage, so records cannot be swapped; the lineage (parent, tokens) is what lets a warm-restarted cache
forget a prefix and everything chained under it, and migrate rescanned blocks.

Invariant: `decode` returns a payload only when both the AES-GCM tag and the plaintext checksum verify; a torn,
foreign or corrupt record is None, never wrong bytes.
"""

from __future__ import annotations

import os
import struct

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gpu_node.engine.block_hash import BlockHash, BlockLineage
from gpu_node.engine.checksum import verify_block

HEADER = struct.Struct("<4sI16s12sQ16sI12s")  # magic, payload ct length, hash, nonce, xxh3, parent, n tokens, nonce
MAGIC = b"KCB2"
NO_PARENT = bytes(16)
AAD_PREFIX = b"kcaas/ssd/v1/"
TAG_BYTES = 16


def encode(
    aead: AESGCM,
    block_hash: BlockHash,
    payload,
    checksum: int,
    lineage: BlockLineage | None,
    *,
    aad_prefix: bytes = AAD_PREFIX,
) -> bytearray:
    """The whole record of one block (lineage: (parent hash, tokens), or None). `aad_prefix` binds the record to
    where it lives (the SSD's by default; the network tier binds each object's name)."""
    num_tokens = len(lineage[1]) if lineage is not None else 0
    record = bytearray(record_bytes(len(payload), num_tokens))
    encode_into(memoryview(record), aead, block_hash, payload, checksum, lineage, aad_prefix=aad_prefix)
    return record


def encode_into(
    out: memoryview,
    aead: AESGCM,
    block_hash: BlockHash,
    payload,
    checksum: int,
    lineage: BlockLineage | None,
    *,
    aad_prefix: bytes = AAD_PREFIX,
) -> int:
    """`encode` into `out` (at least record_bytes long: a reused buffer); returns the record's length."""
    parent, tokens = lineage if lineage is not None else (NO_PARENT, np.zeros(0, np.int32))
    token_bytes = np.ascontiguousarray(tokens, dtype="<i4").tobytes()
    nonce, token_nonce = os.urandom(12), os.urandom(12)
    payload_end = HEADER.size + len(payload) + TAG_BYTES
    length = record_bytes(len(payload), len(tokens))
    assert len(out) >= length, "a record buffer too small"
    HEADER.pack_into(
        out, 0, MAGIC, len(payload) + TAG_BYTES, block_hash, nonce, checksum, bytes(parent), len(tokens), token_nonce
    )
    aad = _aad(block_hash, parent, len(tokens), aad_prefix)
    aead.encrypt_into(nonce, payload, b"kv" + aad, out[HEADER.size : payload_end])
    if len(tokens):
        aead.encrypt_into(token_nonce, token_bytes, b"tk" + aad, out[payload_end:length])
    return length


def decode(
    aead: AESGCM, data, at: int, *, want_lineage: bool = True, aad_prefix: bytes = AAD_PREFIX
) -> tuple[BlockHash, bytearray, int, BlockLineage | None] | None:
    """(block hash, verified payload, record length, lineage) of the record at `at`, or None if torn/corrupt."""
    if len(data) - at < HEADER.size:
        return None
    magic, cipher_len, block_hash, nonce, checksum, parent, num_tokens, token_nonce = HEADER.unpack_from(data, at)
    payload_end = at + HEADER.size + cipher_len
    end = payload_end + (4 * num_tokens + TAG_BYTES if num_tokens else 0)
    if magic != MAGIC or cipher_len < TAG_BYTES or end > len(data):
        return None
    payload = bytearray(cipher_len - TAG_BYTES)
    lineage = None
    try:
        aad = _aad(block_hash, parent, num_tokens, aad_prefix)
        aead.decrypt_into(nonce, data[at + HEADER.size : payload_end], b"kv" + aad, payload)
        if num_tokens and want_lineage:
            tokens = aead.decrypt(token_nonce, bytes(data[payload_end:end]), b"tk" + aad)
            lineage = (BlockHash(parent), np.frombuffer(tokens, dtype="<i4").copy())
    except InvalidTag:
        return None
    if not verify_block(checksum, payload):
        return None
    return BlockHash(block_hash), payload, end - at, lineage


def record_bytes(payload_bytes: int, num_tokens: int) -> int:
    """The length of the record of a `payload_bytes` payload with `num_tokens` tokens of lineage."""
    return HEADER.size + payload_bytes + TAG_BYTES + (4 * num_tokens + TAG_BYTES if num_tokens else 0)


def _aad(block_hash: bytes, parent: bytes, num_tokens: int, prefix: bytes = AAD_PREFIX) -> bytes:
    return prefix + bytes(block_hash) + bytes(parent) + struct.pack("<I", num_tokens)
