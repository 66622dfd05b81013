"""Blocks out of one PagedKVCache and into another, by chained hash, for migration (no Django, no network).

A block travels as a `BlockRecord`: the hash of the prefix it continues (`parent`), its own `key` (its chained hash
when full; for a partial tail a digest of parent + tokens, `partial_key`), the token ids it holds, the xxh3-64
checksum of its stored bytes (pool bytes, then scales when quantized: gpu_node/checksum.py) and those bytes. The
target can rebuild the same prefix chain because the hash key travels with the cache (provisioning): `parent`
of block i is `key` of block i-1, the root for the first block.

Invariants:
- `snapshot()` lists cached blocks parent first (breadth first from the root), so a target inserting them in order
  always finds the parent (unless it was refused or evicted: that block is then an orphan and comes again later);
- `read_block()` holds the block while its bytes are read (never evicted or reused under the reader) and returns
  a private copy for a partial tail (a put may extend it in place); the checksum is over exactly the bytes returned;
- `insert_block()` verifies the checksum before anything is published: a block whose bytes do not match is never
  visible (its allocated slot is freed), and a block is published only under a parent that is cached.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from gpu_node.block_hash import HASH_NUM_BYTES, chain_hashes
from gpu_node.checksum import block_checksum
from gpu_node.paged_cache import PagedKVCache


@dataclass(frozen=True, slots=True)
class BlockMeta:
    block_id: int
    parent: bytes
    key: bytes
    full: bool
    tokens: np.ndarray  # int32, the filled tokens only


def partial_key(parent: bytes, tokens: np.ndarray) -> bytes:
    """The name of a partial tail: BLAKE2b-128 of parent || tokens (a full block is named by its chained hash)."""
    digest = hashlib.blake2b(bytes(parent), digest_size=HASH_NUM_BYTES, person=b"kcaas-partial")
    digest.update(np.ascontiguousarray(tokens, dtype="<i4").tobytes())
    return digest.digest()


def chained_hash(engine: PagedKVCache, parent: bytes, tokens: np.ndarray) -> bytes:
    """h = BLAKE2b_key(parent || tokens of one full block): the name the target checks a full block against."""
    data = np.ascontiguousarray(tokens, dtype="<i4").view(np.uint8)
    return chain_hashes(engine._hasher._key, bytes(parent), data.tobytes(), engine.block_size * 4, HASH_NUM_BYTES)


def root_of(engine: PagedKVCache) -> bytes:
    return bytes(engine._hasher.root)


def snapshot(engine: PagedKVCache) -> list[BlockMeta]:
    """Every cached block, parent first (metadata only; nothing is held)."""
    out: list[BlockMeta] = []
    with engine._lock:
        blocks = engine._blocks
        frontier = [root_of(engine)]
        while frontier:
            parent = frontier.pop(0)
            for block_id in blocks.children(parent):
                filled = int(blocks.num_filled[block_id])
                tokens = blocks.block_tokens[block_id, :filled].copy()
                block_hash = blocks.block_hash[block_id]
                key = bytes(block_hash) if block_hash is not None else partial_key(parent, tokens)
                out.append(BlockMeta(block_id, bytes(parent), key, block_hash is not None, tokens))
                if block_hash is not None:
                    frontier.append(bytes(block_hash))
    return out


def held_keys(engine: PagedKVCache) -> set[bytes]:
    """The keys of every cached block (what a resuming sender may skip)."""
    return {meta.key for meta in snapshot(engine)}


def block_nbytes(engine: PagedKVCache) -> int:
    """Stored bytes of one block: pool bytes plus scales bytes when quantized."""
    scales = engine.scales[0].nbytes if engine.scales is not None else 0
    return engine.pool[0].nbytes + scales


def _still_same(engine: PagedKVCache, meta: BlockMeta) -> bool:
    blocks = engine._blocks
    block_hash = blocks.block_hash[meta.block_id]
    named = bytes(block_hash) if block_hash is not None else None
    return (blocks.block_parent[meta.block_id] == meta.parent and named == (meta.key if meta.full else None)
            and int(blocks.num_filled[meta.block_id]) == len(meta.tokens))  # fmt: skip


def _raw_parts(engine: PagedKVCache, block_id: int) -> list[memoryview]:
    parts = [engine.pool[block_id]] + ([engine.scales[block_id]] if engine.scales is not None else [])
    return [memoryview(p.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()) for p in parts]


class HeldBlock:
    """A block held for reading: `parts` (its stored bytes) and `checksum` of them; release() exactly once."""

    def __init__(self, engine: PagedKVCache, meta: BlockMeta, parts: list[memoryview], checksum: int):
        self.engine, self.meta, self.parts, self.checksum = engine, meta, parts, checksum

    def release(self) -> None:
        self.engine._release([self.meta.block_id])


def read_block(engine: PagedKVCache, meta: BlockMeta) -> HeldBlock | None:
    """Hold `meta`'s block and take its bytes; None when it changed or left the index since the snapshot."""
    with engine._lock:
        if not _still_same(engine, meta):
            return None
        engine._blocks.hold([meta.block_id])
    parts = _raw_parts(engine, meta.block_id)
    if not meta.full:  # a put may extend a partial tail in place while we send it: send a private copy
        parts = [memoryview(bytes(p)) for p in parts]
    return HeldBlock(engine, meta, parts, block_checksum(*parts))


def insert_block(engine: PagedKVCache, parent: bytes, key: bytes, full: bool, tokens: np.ndarray, checksum: int,
                 data: memoryview) -> str:  # fmt: skip
    """Verify and publish one block: "stored", "have" (already cached), "checksum" (bytes do not match: refused),
    "orphan" (its parent is not cached), "full" (no block to put it in), or "bad" (not a block of this cache)."""
    sizes_ok = len(data) == block_nbytes(engine) and 0 < len(tokens) <= engine.block_size
    if not sizes_ok or full != (len(tokens) == engine.block_size):
        return "bad"
    if block_checksum(data) != int(checksum):
        return "checksum"
    if full and chained_hash(engine, parent, tokens) != bytes(key):
        return "bad"  # a full block's name is h(parent || tokens) under this cache's key, or it is not ours
    with engine._lock:
        verdict = _admit(engine, parent, key, full, tokens)
        if verdict != "ok":
            return verdict
        ids = engine._blocks.allocate(1)
        if not ids:
            return "full"
    block_id = ids[0]
    try:
        _write_bytes(engine, block_id, data)
    except BaseException:
        engine._release(ids)
        raise
    with engine._lock:
        try:
            verdict = _admit(engine, parent, key, full, tokens)
            if verdict == "ok":
                engine._blocks.publish_chain([block_id], parent, tokens, [key if full else None])
        finally:
            engine._blocks.release([block_id])  # published: evictable; otherwise freed, never seen
    return "stored" if verdict == "ok" else verdict


def _admit(engine: PagedKVCache, parent: bytes, key: bytes, full: bool, tokens: np.ndarray) -> str:
    """Under the engine lock: may this block be published now?"""
    blocks = engine._blocks
    if parent != root_of(engine) and parent not in blocks.cached_hash_to_block:
        return "orphan"
    if full:
        return "have" if key in blocks.cached_hash_to_block else "ok"
    return "have" if blocks.best_child(parent, tokens)[1] >= len(tokens) else "ok"


def _write_bytes(engine: PagedKVCache, block_id: int, data: memoryview) -> None:
    pool_bytes = engine.pool[0].nbytes
    raw = torch.frombuffer(bytearray(data) if data.readonly else data, dtype=torch.uint8)
    engine.pool[block_id].view(-1).view(torch.uint8).copy_(raw[:pool_bytes])
    if engine.scales is not None:
        engine.scales[block_id].view(-1).view(torch.uint8).copy_(raw[pool_bytes:])


def receive_block(engine: PagedKVCache, parent: bytes, key: bytes, full: bool, tokens: np.ndarray, checksum: int,
                  fill, staging: bytearray) -> str:  # fmt: skip
    """insert_block for bytes still on the wire: `fill(view)` reads exactly one block's bytes into `view`. On a host
    pool without scales they land straight in a freshly allocated (held, unpublished) block: one copy fewer; the
    block is published only after its checksum matched, else freed unseen. Same verdicts as insert_block."""
    if engine.scales is not None or engine.pool.device.type != "cpu" or not 0 < len(tokens) <= engine.block_size:
        fill(memoryview(staging))
        return insert_block(engine, parent, key, full, tokens, checksum, memoryview(staging))
    if full != (len(tokens) == engine.block_size) or (full and chained_hash(engine, parent, tokens) != bytes(key)):
        fill(memoryview(staging))
        return "bad"
    with engine._lock:
        verdict = _admit(engine, parent, key, full, tokens)
        ids = engine._blocks.allocate(1) if verdict == "ok" else []
    if not ids:
        fill(memoryview(staging))  # the bytes must leave the stream either way
        return verdict if verdict != "ok" else "full"
    block_id = ids[0]
    try:
        view = memoryview(engine.pool[block_id].view(-1).view(torch.uint8).numpy())
        fill(view)
        verdict = "ok" if block_checksum(view) == int(checksum) else "checksum"
    except BaseException:
        engine._release(ids)
        raise
    with engine._lock:
        try:
            verdict = _admit(engine, parent, key, full, tokens) if verdict == "ok" else verdict
            if verdict == "ok":
                engine._blocks.publish_chain([block_id], parent, tokens, [key if full else None])
        finally:
            engine._blocks.release([block_id])
    return "stored" if verdict == "ok" else verdict
