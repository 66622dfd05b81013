"""Blocks out of one PagedKVCache and into another, by chained hash, for migration (no Django, no network).

A block travels as a `BlockRecord`: the hash of the prefix it continues (`parent`), its own `key` (its chained hash
when full; for a partial tail a digest of parent + tokens, `partial_key`), the token ids it holds, the xxh3-64
checksum of its stored bytes (pool bytes, then scales when quantized: gpu_node/checksum.py) and those bytes. The
target can rebuild the same prefix chain because the hash key travels with the cache (provisioning): `parent`
of block i is `key` of block i-1, the root for the first block.

Lower tiers: a cache with DRAM/SSD tiers (gpu_node/tiers.py) also holds full blocks there, named by hash, with
their (parent, tokens) in `LowerTiers.lineage`. They are part of the snapshot (`BlockMeta.lower`) and are read with
`LowerTiers.peek` (checksum verified, nothing promoted, so reading them never evicts the source's device blocks).

Invariants:
- `snapshot()` lists device and lower-tier blocks depth first from the root, a parent always before its children
  (and a child right after its parent's subtree starts, so a small target pool still holds the parent when the child
  arrives); a block on both the device and SSD is listed once (device); a lower-tier block whose parent is in no
  tier and not on the device is unreachable and not listed;
- `read_block()` holds a device block while its bytes are read (never evicted or reused under the reader) and returns
  a private copy for a partial tail or a lower-tier block; the checksum is over exactly the bytes returned;
- `insert_block()` verifies the checksum before anything is published: a block whose bytes do not match is never
  visible (its allocated slot is freed); a block is published on the device only under a parent cached there, and a
  full block whose parent the target holds only in a lower tier is demoted straight there (with its lineage);
- on a target with lower tiers, every device allocation demotes what it evicts (tiers.demote_evicted), as a put does.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from gpu_node.block_hash import HASH_NUM_BYTES
from gpu_node.checksum import block_checksum
from gpu_node.paged_cache import PagedKVCache


@dataclass(frozen=True, slots=True)
class BlockMeta:
    block_id: int
    parent: bytes
    key: bytes
    full: bool
    tokens: np.ndarray  # int32, the filled tokens only
    lower: bool = False  # held in a lower tier (DRAM/SSD), not in the device pool (block_id is then -1)


def partial_key(parent: bytes, tokens: np.ndarray) -> bytes:
    """The name of a partial tail: BLAKE2b-128 of parent || tokens (a full block is named by its chained hash)."""
    digest = hashlib.blake2b(bytes(parent), digest_size=HASH_NUM_BYTES, person=b"kcaas-partial")
    digest.update(np.ascontiguousarray(tokens, dtype="<i4").tobytes())
    return digest.digest()


def chained_hash(engine: PagedKVCache, parent: bytes, tokens: np.ndarray) -> bytes:
    """h = BLAKE2b_key(parent || tokens of one full block): the name the target checks a full block against."""
    return bytes(engine._hasher.chained_hash(parent, tokens))


def root_of(engine: PagedKVCache) -> bytes:
    return bytes(engine._hasher.root)


def snapshot(engine: PagedKVCache) -> list[BlockMeta]:
    """Every cached block, device and lower tiers, depth first from the root (metadata only; nothing is held)."""
    out: list[BlockMeta] = []
    with engine._lock:
        lower = _lower_children(engine)
        stack = [root_of(engine)]
        while stack:
            parent = stack.pop()
            children = _device_children(engine, parent) + lower.get(parent, [])
            out.extend(children)
            stack.extend(meta.key for meta in reversed(children) if meta.full)
    return _depth_first(out, root_of(engine))


def _device_children(engine: PagedKVCache, parent: bytes) -> list[BlockMeta]:
    """Under the engine lock: the device blocks cached under `parent`."""
    blocks, out = engine._blocks, []
    for block_id in blocks.children(parent):
        tokens = blocks.block_tokens[block_id, : int(blocks.num_filled[block_id])].copy()
        block_hash = blocks.block_hash[block_id]
        key = bytes(block_hash) if block_hash is not None else partial_key(parent, tokens)
        out.append(BlockMeta(block_id, bytes(parent), key, block_hash is not None, tokens))
    return sorted(out, key=lambda meta: meta.full)  # partial tails first: they follow their parent at once


def _lower_children(engine: PagedKVCache) -> dict[bytes, list[BlockMeta]]:
    """Under the engine lock: parent hash -> the lower-tier blocks under it (those also on the device left out)."""
    out: dict[bytes, list[BlockMeta]] = {}
    if engine._tiers is None:
        return out
    on_device = engine._blocks.cached_hash_to_block
    for key, (parent, tokens) in engine._tiers.present_lineage().items():
        if key not in on_device:
            out.setdefault(parent, []).append(BlockMeta(-1, parent, key, True, tokens, lower=True))
    return out


def _depth_first(metas: list[BlockMeta], root: bytes) -> list[BlockMeta]:
    """Reorder a parent-first listing (children of one parent are contiguous) into depth-first order."""
    children: dict[bytes, list[BlockMeta]] = {}
    for meta in metas:
        children.setdefault(meta.parent, []).append(meta)
    out, stack = [], list(reversed(children.get(root, [])))
    while stack:
        meta = stack.pop()
        out.append(meta)
        if meta.full:
            stack.extend(reversed(children.get(meta.key, [])))
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
        if not self.meta.lower:  # a lower-tier block is a private copy: nothing is held
            self.engine._release([self.meta.block_id])


def read_block(engine: PagedKVCache, meta: BlockMeta) -> HeldBlock | None:
    """Hold `meta`'s block and take its bytes; None when it changed or left the index (or its tier) since the
    snapshot. A lower-tier block is read with a verified peek: never promoted, so nothing on the device is evicted."""
    if meta.lower:
        payload = engine._tiers.peek(meta.key) if engine._tiers is not None else None
        if payload is None:
            return None
        return HeldBlock(engine, meta, [memoryview(payload)], block_checksum(payload))
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
    if not full and engine._tiers is not None:
        _promote_parent(engine, parent)
    with engine._lock:
        verdict = _admit(engine, parent, key, full, tokens)
        if verdict == "ok" and full and engine._tiers is not None and not engine._blocks.num_free_blocks:
            verdict = "lower"  # a full device pool: the arriving block is the one demoted (no eviction cascades)
        if verdict == "lower":
            return _demote_received(engine, parent, key, tokens, data)
        if verdict != "ok":
            return verdict
        ids = _allocate_one(engine)
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
            elif verdict == "lower":  # the parent was demoted meanwhile: so is this block
                verdict = "ok" if _demote_received(engine, parent, key, tokens, data) == "stored" else verdict
        finally:
            engine._blocks.release([block_id])  # published: evictable; otherwise freed, never seen
    return "stored" if verdict == "ok" else verdict


def _promote_parent(engine: PagedKVCache, parent: bytes) -> None:
    """A partial tail lives on the device only: bring its parent's chain up from the lower tiers if needed."""
    with engine._lock:
        if parent == root_of(engine) or parent in engine._blocks.cached_hash_to_block:
            return
        tokens = _chain_tokens(engine, parent)
    if tokens is not None:
        engine._promote(tokens, engine._hasher.block_chain(tokens))


def _chain_tokens(engine: PagedKVCache, key: bytes) -> np.ndarray | None:
    """Under the engine lock: the tokens of the prefix ending with full block `key` (device or lineage), or None."""
    blocks, lineage, root, parts = engine._blocks, engine._tiers.lineage, root_of(engine), []
    while key != root:
        block_id = blocks.cached_hash_to_block.get(key)
        if block_id is not None:
            key, tokens = blocks.block_parent[block_id], blocks.block_tokens[block_id]
        elif key in lineage:
            key, tokens = lineage[key]
        else:
            return None
        parts.append(tokens)
        key = bytes(key)
    return np.concatenate(parts[::-1]).astype(np.int32)


def _allocate_one(engine: PagedKVCache) -> list[int]:
    """Under the engine lock: one block for a received block; what the allocation evicts is demoted (as in put)."""
    return engine._allocate_device(1)


def _demote_received(engine: PagedKVCache, parent: bytes, key: bytes, tokens: np.ndarray, data) -> str:
    """Under the engine lock: keep a verified full block whose parent is only in a lower tier there too."""
    engine._tiers.demote(bytes(key), bytearray(data), (bytes(parent), tokens))
    return "stored"


def _admit(engine: PagedKVCache, parent: bytes, key: bytes, full: bool, tokens: np.ndarray) -> str:
    """Under the engine lock: may this block be published now? "ok" (on the device), "lower" (a full block whose
    parent only a lower tier holds: it goes there too), "have", or "orphan" (a partial tail whose parent is not on
    the device is refused as an orphan and comes again; partial tails are sent right after their parent)."""
    blocks, lower = engine._blocks, engine._tiers
    if full and (key in blocks.cached_hash_to_block or (lower is not None and _lower_has(lower, key))):
        return "have"
    if parent != root_of(engine) and parent not in blocks.cached_hash_to_block:
        return "lower" if full and lower is not None and _lower_has(lower, parent) else "orphan"
    if full:
        return "ok"
    return "have" if blocks.best_child(parent, tokens)[1] >= len(tokens) else "ok"


def _lower_has(lower, key: bytes) -> bool:
    """A lower tier holds `key` with its lineage (a block without lineage cannot be a migrated parent)."""
    return key in lower.lineage and lower.has(key)


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
    direct = engine.scales is None and engine.pool.device.type == "cpu" and engine._tiers is None
    if not direct or not 0 < len(tokens) <= engine.block_size:
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
