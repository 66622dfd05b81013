"""BlockExchange: one block at a time, by chained hash — what migration (and its journal) asks of a PagedKVCache, and
the only way they reach its state.

PagedKVCache is composed of it (with TierMoves and PurgeFence, sharing one CacheState) and hands it out as
`cache.exchange`; gpu_node/migration/block_transfer.py builds the migration's snapshot, reads and inserts on top of it
and never touches the cache's lock, block pool, hasher or tiers itself.

Interface (each method takes and releases the cache lock itself; none is called with it held):
- `root_hash`, `chained_hash(parent, tokens)`: the names a receiver checks blocks against;
- `list_blocks()`: every cached block, device then lower tiers, as BlockMeta (children of one parent contiguous,
  each key once: a block on the device and on SSD is listed as the device's);
- `hold_block(meta)` -> the block's stored bytes, held until `release_block(meta)`; None when the block changed or
  left the index since it was listed. Lower-tier blocks and partial tails are private (writable) copies, which the
  caller zeroes when done (nothing promoted, nothing held);
- `block_payload(key)`: a private copy of a full block's stored bytes from the device or a lower tier;
- `write_through(parent, key, tokens)`: queue a held block for the SSD now (a migration target's journal);
- `admit_block(...)`: may a verified block be published now ("ok", "lower", "have", "orphan");
- `store_block(...)`: publish a verified block's bytes (the device, or the lower tiers when its parent lives only
  there); `receive_block_in_place(...)`: the same with the bytes read straight into an allocated device block
  (when `can_receive_in_place()`).
A purged cache answers every one of them with CachePurged.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from gpu_node.engine.block_hash import HASH_NUM_BYTES, BlockHash
from gpu_node.engine.cache_state import CacheState
from gpu_node.engine.checksum import block_checksum
from gpu_node.engine.tier_moves import TierMoves
from gpu_node.engine.zeroing import zero
from gpu_node.tiers.lower_tiers import block_payloads


@dataclass(frozen=True, slots=True)
class BlockMeta:
    block_id: int
    parent: BlockHash
    key: BlockHash
    full: bool
    tokens: np.ndarray  # int32, the filled tokens only
    lower: bool = False  # held in a lower tier (DRAM/SSD), not in the device pool (block_id is then -1)


def partial_key(parent: BlockHash, tokens: np.ndarray) -> BlockHash:
    """The name of a partial tail: BLAKE2b-128 of parent || tokens (a full block is named by its chained hash)."""
    digest = hashlib.blake2b(bytes(parent), digest_size=HASH_NUM_BYTES, person=b"kcaas-partial")
    digest.update(np.ascontiguousarray(tokens, dtype="<i4").tobytes())
    return BlockHash(digest.digest())


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's bytes on the host: a view of a contiguous host tensor's own memory, else of a copy."""
    return tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy().data


class BlockExchange:
    """A cache's blocks as a migration moves them (module docstring); `state` and `moves` are the cache's."""

    def __init__(self, state: CacheState, moves: TierMoves):
        self._state = state
        self._moves = moves

    @property
    def root_hash(self) -> BlockHash:
        return self._state.hasher.root

    def chained_hash(self, parent: BlockHash, tokens: np.ndarray) -> BlockHash:
        """h = BLAKE2b_key(parent || tokens of one full block) under this cache's key."""
        return self._state.hasher.chained_hash(parent, tokens)

    @property
    def block_nbytes(self) -> int:
        """Stored bytes of one block: pool bytes plus scales bytes when quantized."""
        return self._state.pool[0].nbytes + (self._state.scales[0].nbytes if self._state.scales is not None else 0)

    # ---- the source side ------------------------------------------------------------------------------------------
    def list_blocks(self) -> list[BlockMeta]:
        """Every cached block (metadata only; nothing is held), parents before children."""
        with self._state.lock:
            self._state.check_not_purged()
            lower = self._lower_children()
            out: list[BlockMeta] = []
            stack: list[BlockHash] = [self.root_hash]
            while stack:
                parent = stack.pop()
                children = self._device_children(parent) + lower.get(parent, [])
                out.extend(children)
                stack.extend(meta.key for meta in reversed(children) if meta.full)
        return out

    def _device_children(self, parent: BlockHash) -> list[BlockMeta]:
        blocks, out = self._state.blocks, []
        for block_id in blocks.children(parent):
            tokens = blocks.block_tokens[block_id, : int(blocks.num_filled[block_id])].copy()
            block_hash = blocks.block_hash[block_id]
            key = block_hash if block_hash is not None else partial_key(parent, tokens)
            out.append(BlockMeta(block_id, parent, key, block_hash is not None, tokens))
        return sorted(out, key=lambda meta: meta.full)  # partial tails first: they follow their parent at once

    def _lower_children(self) -> dict[BlockHash, list[BlockMeta]]:
        out: dict[BlockHash, list[BlockMeta]] = {}
        if self._state.tiers is None:
            return out
        on_device = self._state.blocks.cached_hash_to_block
        for key, (parent, tokens) in self._state.lower().present_lineage().items():
            if key not in on_device:
                out.setdefault(parent, []).append(BlockMeta(-1, parent, key, True, tokens, lower=True))
        return out

    def hold_block(self, meta: BlockMeta) -> list[memoryview] | None:
        """The stored bytes of a listed block (pool bytes, then scales), held until release_block; None when it
        changed or left its tier since it was listed. A partial tail (a put may extend it in place) and a
        lower-tier block are private copies."""
        if meta.lower:
            payload = self._state.lower().peek(meta.key) if self._state.tiers is not None else None
            return [memoryview(payload)] if payload is not None else None
        with self._state.lock:
            self._state.check_not_purged()
            if not self._still_same(meta):
                return None
            self._state.blocks.hold([meta.block_id])
        tensors = [self._state.pool[meta.block_id]]
        if self._state.scales is not None:
            tensors.append(self._state.scales[meta.block_id])
        parts = [_host_bytes(tensor) for tensor in tensors]
        return parts if meta.full else [memoryview(bytearray(part)) for part in parts]

    def release_block(self, meta: BlockMeta) -> None:
        if not meta.lower:
            self._state.release([meta.block_id])

    def _still_same(self, meta: BlockMeta) -> bool:
        blocks = self._state.blocks
        block_hash = blocks.block_hash[meta.block_id]
        named = bytes(block_hash) if block_hash is not None else None
        return (
            blocks.block_parent[meta.block_id] == meta.parent
            and named == (meta.key if meta.full else None)
            and int(blocks.num_filled[meta.block_id]) == len(meta.tokens)
        )

    def block_payload(self, key: BlockHash) -> bytearray | None:
        """A private copy of full block `key`'s stored bytes, from the device pool or a lower tier; None if gone."""
        with self._state.lock:
            self._state.check_not_purged()
            block_id = self._state.blocks.cached_hash_to_block.get(key)
            if block_id is not None:
                return block_payloads(self._state.pool, self._state.scales, [block_id])[0]
        return self._state.lower().peek(key) if self._state.tiers is not None else None

    def write_through(self, parent: BlockHash, key: BlockHash, tokens: np.ndarray) -> bool:
        """Queue a copy of full block `key` (from the device or a lower tier) for the SSD now, with its lineage, not
        only when it is evicted (a migration target's journal: durable at the store's next flush). False without an
        SSD tier, or when the block is gone (deleted or evicted out of every tier meanwhile)."""
        if self._state.tiers is None or self._state.lower().ssd is None:
            return False
        payload = self.block_payload(key)
        if payload is None:
            return False
        with self._state.lock:
            self._state.check_not_purged()
            if key not in self._state.blocks.cached_hash_to_block and not self._state.lower().has(key):
                zero(payload)  # forgotten while it was copied
                return False
            self._state.lower().write_through(key, payload, (parent, tokens))
        return True

    def adopt_network_blocks(self, entries: list[tuple[BlockHash, BlockHash, np.ndarray]]) -> int:
        """Full blocks (parent, key, tokens) another node says the network store holds (TierMoves.adopt_network_blocks).

        Returns: how many of them the cache's network tier holds now."""
        return self._moves.adopt_network_blocks(entries)

    # ---- the target side ------------------------------------------------------------------------------------------
    def admit_block(self, parent: BlockHash, key: BlockHash, full: bool, tokens: np.ndarray) -> str:
        with self._state.lock:
            self._state.check_not_purged()
            return self._admit_locked(parent, key, full, tokens)

    def _admit_locked(self, parent: BlockHash, key: BlockHash, full: bool, tokens: np.ndarray) -> str:
        """May this block be published now? "ok" (on the device), "lower" (a full block whose parent only a lower
        tier holds: it goes there too), "have", or "orphan" (a partial tail whose parent is not on the device is
        refused as an orphan and comes again; partial tails are sent right after their parent)."""
        blocks, lower = self._state.blocks, self._state.tiers
        if full and (key in blocks.cached_hash_to_block or (lower is not None and self._lower_has(key))):
            return "have"
        if parent != self.root_hash and parent not in blocks.cached_hash_to_block:
            return "lower" if full and lower is not None and self._lower_has(parent) else "orphan"
        if full:
            return "ok"
        return "have" if blocks.best_child(parent, tokens)[1] >= len(tokens) else "ok"

    def _lower_has(self, key: BlockHash) -> bool:
        """A lower tier holds `key` with its lineage (a block without lineage cannot be a migrated parent)."""
        return key in self._state.lower().lineage and self._state.lower().has(key)

    def store_block(self, parent: BlockHash, key: BlockHash, full: bool, tokens: np.ndarray, data: memoryview) -> str:
        """Publish a block whose bytes were verified: "stored", or admit_block's "have"/"orphan", or "full"."""
        if not full and self._state.tiers is not None:
            self._promote_parent(parent)
        with self._state.lock:
            self._state.check_not_purged()
            verdict = self._admit_locked(parent, key, full, tokens)
            if verdict == "ok" and full and self._state.tiers is not None and not self._state.blocks.num_free_blocks:
                verdict = "lower"  # a full device pool: the arriving block is the one demoted (no eviction cascades)
            if verdict == "lower":
                return self._demote_received(parent, key, tokens, data)
            if verdict != "ok":
                return verdict
            ids = self._moves.allocate_device(1)
            if not ids:
                return "full"
        return self._write_and_publish(ids[0], parent, key, full, tokens, data)

    def _write_and_publish(self, block_id: int, parent, key, full, tokens, data) -> str:
        try:
            self._write_block_bytes(block_id, data)
        except BaseException:
            self._state.release([block_id])
            raise
        return self._publish_received(block_id, parent, key, full, tokens, data)

    def _publish_received(self, block_id: int, parent, key, full: bool, tokens: np.ndarray, data) -> str:
        """A held block whose bytes are written and verified: published if it may be now (a full block whose
        parent was demoted meanwhile is demoted too), and released either way (published: evictable; otherwise
        freed, never seen). Returns "stored" or admit_block's verdict."""
        with self._state.lock:
            try:
                self._state.check_not_purged()
                verdict = self._admit_locked(parent, key, full, tokens)
                if verdict == "ok":
                    self._state.blocks.publish_chain([block_id], parent, tokens, [key if full else None])
                elif verdict == "lower":
                    verdict = "ok" if self._demote_received(parent, key, tokens, data) == "stored" else verdict
            finally:
                self._state.blocks.release([block_id])
        return "stored" if verdict == "ok" else verdict

    def can_receive_in_place(self) -> bool:
        """A host pool without scales or tiers: received bytes can land straight in a device block."""
        return self._state.scales is None and self._state.pool.device.type == "cpu" and self._state.tiers is None

    def receive_block_in_place(
        self, parent, key, full: bool, tokens: np.ndarray, checksum: int, fill
    ) -> tuple[str, bool]:
        """The direct receive (can_receive_in_place): read one block's bytes with `fill(view)` straight into a
        freshly allocated (held, unpublished) block, published only if its checksum matches (else freed unseen).
        Returns (verdict, whether the bytes were read): a block refused before its bytes are read leaves them to
        the caller to drain."""
        with self._state.lock:
            self._state.check_not_purged()
            verdict = self._admit_locked(parent, key, full, tokens)
            ids = self._state.blocks.allocate(1) if verdict == "ok" else []
        if not ids:
            return (verdict if verdict != "ok" else "full"), False
        block_id = ids[0]
        try:
            view = _host_bytes(self._state.pool[block_id])
            fill(view)
            matches = block_checksum(view) == int(checksum)
        except BaseException:
            self._state.release(ids)
            raise
        if not matches:
            self._state.release(ids)  # freed unseen
            return "checksum", True
        return self._publish_received(block_id, parent, key, full, tokens, view), True

    def _promote_parent(self, parent: BlockHash) -> None:
        """A partial tail lives on the device only: bring its parent's chain up from the lower tiers if needed."""
        with self._state.lock:
            if parent == self.root_hash or parent in self._state.blocks.cached_hash_to_block:
                return
            tokens = self._chain_tokens(parent)
        if tokens is not None:
            self._moves.promote(tokens, self._state.hasher.block_chain(tokens))

    def _chain_tokens(self, key: BlockHash) -> np.ndarray | None:
        """Under the lock: the tokens of the prefix ending with full block `key` (device or lineage), or None."""
        blocks, lineage, root, parts = self._state.blocks, self._state.lower().lineage, self.root_hash, []
        while key != root:
            block_id = blocks.cached_hash_to_block.get(key)
            parent: BlockHash | None
            if block_id is not None:
                parent, tokens = blocks.block_parent[block_id], blocks.block_tokens[block_id]
            elif key in lineage:
                parent, tokens = lineage[key]
            else:
                return None
            if parent is None:
                return None
            parts.append(tokens)
            key = parent
        return np.concatenate(parts[::-1]).astype(np.int32)

    def _demote_received(self, parent: BlockHash, key: BlockHash, tokens: np.ndarray, data) -> str:
        """Under the lock: keep a verified full block whose parent is only in a lower tier there too."""
        self._state.lower().demote(key, bytearray(data), (parent, tokens))
        return "stored"

    def _write_block_bytes(self, block_id: int, data: memoryview) -> None:
        pool_bytes = self._state.pool[0].nbytes
        raw = torch.frombuffer(bytearray(data) if data.readonly else data, dtype=torch.uint8)
        self._state.pool[block_id].view(-1).view(torch.uint8).copy_(raw[:pool_bytes])
        if self._state.scales is not None:
            self._state.scales[block_id].view(-1).view(torch.uint8).copy_(raw[pool_bytes:])
