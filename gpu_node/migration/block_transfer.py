"""Blocks out of one PagedKVCache and into another, by chained hash, for migration (no Django, no network).

A block travels as a `BlockRecord`: the hash of the prefix it continues (`parent`), its own `key` (its chained hash
when full; for a partial tail a digest of parent + tokens, `partial_key`), the token ids it holds, the xxh3-64
checksum of its stored bytes (pool bytes, then scales when quantized: gpu_node/engine/checksum.py) and those bytes. The
target can rebuild the same prefix chain because the hash key travels with the cache (provisioning): `parent`
of block i is `key` of block i-1, the root for the first block.

Everything here goes through the engine facade's block exchange (gpu_node/engine/block_exchange.py: list_blocks,
hold_block/release_block, admit_block, store_block, receive_block_in_place): this module never touches the cache's
lock, pool metadata, hasher or tiers.

Lower tiers: a cache with DRAM/SSD tiers (gpu_node/tiers/lower_tiers.py) also holds full blocks there, named by hash,
with their (parent, tokens) lineage (durable on SSD). They are part of the snapshot (`BlockMeta.lower`) and are read as
verified copies (nothing promoted, so reading them never evicts the source's device blocks).

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

import numpy as np

from gpu_node.engine.block_exchange import BlockMeta, partial_key  # noqa: F401 - partial_key is part of this module's API
from gpu_node.engine.block_hash import BlockHash
from gpu_node.engine.checksum import block_checksum
from gpu_node.engine.paged_cache import PagedKVCache
from gpu_node.engine.zeroing import zero


def chained_hash(engine: PagedKVCache, parent: BlockHash, tokens: np.ndarray) -> bytes:
    """h = BLAKE2b_key(parent || tokens of one full block): the name the target checks a full block against."""
    return engine.exchange.chained_hash(parent, tokens)


def root_of(engine: PagedKVCache) -> bytes:
    return engine.exchange.root_hash


def snapshot(engine: PagedKVCache) -> list[BlockMeta]:
    """Every cached block, device and lower tiers, depth first from the root (metadata only; nothing is held)."""
    return _depth_first(engine.exchange.list_blocks(), engine.exchange.root_hash)


def _depth_first(metas: list[BlockMeta], root: BlockHash) -> list[BlockMeta]:
    """Reorder a parent-first listing (children of one parent are contiguous) into depth-first order."""
    children: dict[BlockHash, list[BlockMeta]] = {}
    for meta in metas:
        children.setdefault(meta.parent, []).append(meta)
    out, stack = [], list(reversed(children.get(root, [])))
    while stack:
        meta = stack.pop()
        out.append(meta)
        if meta.full:
            stack.extend(reversed(children.get(meta.key, [])))
    return out


def held_keys(engine: PagedKVCache) -> set[BlockHash]:
    """The keys of every cached block (what a resuming sender may skip)."""
    return {meta.key for meta in engine.exchange.list_blocks()}


def block_nbytes(engine: PagedKVCache) -> int:
    """Stored bytes of one block: pool bytes plus scales bytes when quantized."""
    return engine.exchange.block_nbytes


class HeldBlock:
    """A block held for reading: `parts` (its stored bytes) and `checksum` of them; release() exactly once."""

    def __init__(self, engine: PagedKVCache, meta: BlockMeta, parts: list[memoryview], checksum: int):
        self.engine, self.meta, self.parts, self.checksum = engine, meta, parts, checksum

    def release(self) -> None:
        self.engine.exchange.release_block(self.meta)
        if self.meta.lower or not self.meta.full:  # private copies of KV: zeroed before they are freed
            for part in self.parts:
                zero(part)


def read_block(engine: PagedKVCache, meta: BlockMeta) -> HeldBlock | None:
    """Hold `meta`'s block and take its bytes; None when it changed or left the index (or its tier) since the
    snapshot. A lower-tier block is read with a verified peek: never promoted, so nothing on the device is evicted."""
    parts = engine.exchange.hold_block(meta)
    if parts is None:
        return None
    return HeldBlock(engine, meta, parts, block_checksum(*parts))


def _not_ours(engine: PagedKVCache, parent: BlockHash, key: BlockHash, full: bool, tokens: np.ndarray) -> bool:
    """Not a block of this cache: a token count it cannot hold, or a full block not named h(parent || tokens)."""
    if not 0 < len(tokens) <= engine.block_size or full != (len(tokens) == engine.block_size):
        return True
    return full and engine.exchange.chained_hash(parent, tokens) != bytes(key)


def network_held(engine: PagedKVCache, metas: list[BlockMeta]) -> list[BlockMeta]:
    """The full blocks among `metas` that the engine's network tier has stored (not merely queued: its writes are
    flushed first): a migration target with the same keys reads them from the store instead of the wire."""
    network = engine.tiers.network if engine.tiers is not None else None
    if network is None:
        return []
    network.flush()
    return [meta for meta in metas if meta.full and network.is_stored(meta.key)]


def adopt_network_blocks(engine: PagedKVCache, metas: list[BlockMeta]) -> int:
    """Migration target: of the full blocks a source says the network store holds, those named h(parent || tokens)
    under this cache's key and confirmed by the store join this engine's network tier (index and lineage), so the
    next K lists them and the sender skips them. Returns how many joined."""
    ours = [meta for meta in metas if not _not_ours(engine, meta.parent, meta.key, True, meta.tokens)]
    return engine.exchange.adopt_network_blocks([(meta.parent, meta.key, meta.tokens) for meta in ours])


def insert_block(
    engine: PagedKVCache,
    parent: BlockHash,
    key: BlockHash,
    full: bool,
    tokens: np.ndarray,
    checksum: int,
    data: memoryview,
) -> str:
    """Verify and publish one block: "stored", "have" (already cached), "checksum" (bytes do not match: refused),
    "orphan" (its parent is not cached), "full" (no block to put it in), or "bad" (not a block of this cache)."""
    if len(data) != engine.exchange.block_nbytes or not 0 < len(tokens) <= engine.block_size:
        return "bad"
    if full != (len(tokens) == engine.block_size):  # checked before the checksum, the name after it
        return "bad"
    if block_checksum(data) != int(checksum):
        return "checksum"
    if _not_ours(engine, parent, key, full, tokens):
        return "bad"
    return engine.exchange.store_block(parent, key, full, tokens, data)


def receive_block(
    engine: PagedKVCache,
    parent: BlockHash,
    key: BlockHash,
    full: bool,
    tokens: np.ndarray,
    checksum: int,
    fill,
    staging: bytearray,
) -> str:
    """insert_block for bytes still on the wire: `fill(view)` reads exactly one block's bytes into `view`. On a host
    pool without scales they land straight in a freshly allocated (held, unpublished) block: one copy fewer; the
    block is published only after its checksum matched, else freed unseen. Same verdicts as insert_block."""
    if not engine.exchange.can_receive_in_place() or not 0 < len(tokens) <= engine.block_size:
        fill(memoryview(staging))
        return insert_block(engine, parent, key, full, tokens, checksum, memoryview(staging))
    if _not_ours(engine, parent, key, full, tokens):
        fill(memoryview(staging))
        return "bad"
    verdict, consumed = engine.exchange.receive_block_in_place(parent, key, full, tokens, checksum, fill)
    if not consumed:
        fill(memoryview(staging))  # the bytes must leave the stream either way
    return verdict
