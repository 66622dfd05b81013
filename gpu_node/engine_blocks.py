"""The engine facade's block exchange: one block at a time, by chained hash — what migration (and its journal) asks
of a PagedKVCache, and the only way they reach its state.

PagedKVCache inherits these methods; gpu_node/block_transfer.py builds the migration's snapshot, reads and inserts
on top of them and never touches the cache's lock, block pool, hasher or tiers itself.

Interface (each method takes and releases the cache lock itself; none is called with it held):
- `root_hash`, `chained_hash(parent, tokens)`: the names a receiver checks blocks against;
- `list_blocks()`: every cached block, device then lower tiers, as BlockMeta (children of one parent contiguous,
  each key once: a block on the device and on SSD is listed as the device's);
- `hold_block(meta)` -> the block's stored bytes, held until `release_block(meta)`; None when the block changed or
  left the index since it was listed. Lower-tier blocks and partial tails are private (writable) copies, which the
  caller zeroes when done (nothing promoted, nothing held);
- `block_payload(key)`: a private copy of a full block's stored bytes from the device or a lower tier;
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

from gpu_node.block_hash import HASH_NUM_BYTES
from gpu_node.checksum import block_checksum
from gpu_node.tiers import block_payloads


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


class BlockExchange:
    """Mixin of PagedKVCache: its blocks as a migration moves them."""

    @property
    def root_hash(self) -> bytes:
        return bytes(self._hasher.root)

    def chained_hash(self, parent: bytes, tokens: np.ndarray) -> bytes:
        """h = BLAKE2b_key(parent || tokens of one full block) under this cache's key."""
        return bytes(self._hasher.chained_hash(parent, tokens))

    @property
    def block_nbytes(self) -> int:
        """Stored bytes of one block: pool bytes plus scales bytes when quantized."""
        return self.pool[0].nbytes + (self.scales[0].nbytes if self.scales is not None else 0)

    # ---- the source side ------------------------------------------------------------------------------------------
    def list_blocks(self) -> list[BlockMeta]:
        """Every cached block (metadata only; nothing is held), parents before children."""
        with self._lock:
            self._check_not_purged()
            lower = self._lower_children()
            out, stack = [], [self.root_hash]
            while stack:
                parent = stack.pop()
                children = self._device_children(parent) + lower.get(parent, [])
                out.extend(children)
                stack.extend(meta.key for meta in reversed(children) if meta.full)
        return out

    def _device_children(self, parent: bytes) -> list[BlockMeta]:
        blocks, out = self._blocks, []
        for block_id in blocks.children(parent):
            tokens = blocks.block_tokens[block_id, : int(blocks.num_filled[block_id])].copy()
            block_hash = blocks.block_hash[block_id]
            key = bytes(block_hash) if block_hash is not None else partial_key(parent, tokens)
            out.append(BlockMeta(block_id, bytes(parent), key, block_hash is not None, tokens))
        return sorted(out, key=lambda meta: meta.full)  # partial tails first: they follow their parent at once

    def _lower_children(self) -> dict[bytes, list[BlockMeta]]:
        out: dict[bytes, list[BlockMeta]] = {}
        if self._tiers is None:
            return out
        on_device = self._blocks.cached_hash_to_block
        for key, (parent, tokens) in self._tiers.present_lineage().items():
            if key not in on_device:
                out.setdefault(parent, []).append(BlockMeta(-1, parent, key, True, tokens, lower=True))
        return out

    def hold_block(self, meta: BlockMeta) -> list[memoryview] | None:
        """The stored bytes of a listed block (pool bytes, then scales), held until release_block; None when it
        changed or left its tier since it was listed. A partial tail (a put may extend it in place) and a
        lower-tier block are private copies."""
        if meta.lower:
            payload = self._tiers.peek(meta.key) if self._tiers is not None else None
            return [memoryview(payload)] if payload is not None else None
        with self._lock:
            self._check_not_purged()
            if not self._still_same(meta):
                return None
            self._blocks.hold([meta.block_id])
        parts = [self.pool[meta.block_id]] + ([self.scales[meta.block_id]] if self.scales is not None else [])
        parts = [memoryview(p.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()) for p in parts]
        return parts if meta.full else [memoryview(bytearray(p)) for p in parts]

    def release_block(self, meta: BlockMeta) -> None:
        if not meta.lower:
            self._release([meta.block_id])

    def _still_same(self, meta: BlockMeta) -> bool:
        blocks = self._blocks
        block_hash = blocks.block_hash[meta.block_id]
        named = bytes(block_hash) if block_hash is not None else None
        return (
            blocks.block_parent[meta.block_id] == meta.parent
            and named == (meta.key if meta.full else None)
            and int(blocks.num_filled[meta.block_id]) == len(meta.tokens)
        )

    def block_payload(self, key: bytes) -> bytearray | None:
        """A private copy of full block `key`'s stored bytes, from the device pool or a lower tier; None if gone."""
        with self._lock:
            self._check_not_purged()
            block_id = self._blocks.cached_hash_to_block.get(bytes(key))
            if block_id is not None:
                return block_payloads(self.pool, self.scales, [block_id])[0]
        return self._tiers.peek(bytes(key)) if self._tiers is not None else None

    # ---- the target side ------------------------------------------------------------------------------------------
    def admit_block(self, parent: bytes, key: bytes, full: bool, tokens: np.ndarray) -> str:
        with self._lock:
            self._check_not_purged()
            return self._admit_locked(parent, key, full, tokens)

    def _admit_locked(self, parent: bytes, key: bytes, full: bool, tokens: np.ndarray) -> str:
        """May this block be published now? "ok" (on the device), "lower" (a full block whose parent only a lower
        tier holds: it goes there too), "have", or "orphan" (a partial tail whose parent is not on the device is
        refused as an orphan and comes again; partial tails are sent right after their parent)."""
        blocks, lower = self._blocks, self._tiers
        if full and (key in blocks.cached_hash_to_block or (lower is not None and self._lower_has(key))):
            return "have"
        if parent != self.root_hash and parent not in blocks.cached_hash_to_block:
            return "lower" if full and lower is not None and self._lower_has(parent) else "orphan"
        if full:
            return "ok"
        return "have" if blocks.best_child(parent, tokens)[1] >= len(tokens) else "ok"

    def _lower_has(self, key: bytes) -> bool:
        """A lower tier holds `key` with its lineage (a block without lineage cannot be a migrated parent)."""
        return key in self._tiers.lineage and self._tiers.has(key)

    def store_block(self, parent: bytes, key: bytes, full: bool, tokens: np.ndarray, data: memoryview) -> str:
        """Publish a block whose bytes were verified: "stored", or admit_block's "have"/"orphan", or "full"."""
        if not full and self._tiers is not None:
            self._promote_parent(parent)
        with self._lock:
            self._check_not_purged()
            verdict = self._admit_locked(parent, key, full, tokens)
            if verdict == "ok" and full and self._tiers is not None and not self._blocks.num_free_blocks:
                verdict = "lower"  # a full device pool: the arriving block is the one demoted (no eviction cascades)
            if verdict == "lower":
                return self._demote_received(parent, key, tokens, data)
            if verdict != "ok":
                return verdict
            ids = self._allocate_device(1)
            if not ids:
                return "full"
        return self._write_and_publish(ids[0], parent, key, full, tokens, data)

    def _write_and_publish(self, block_id: int, parent, key, full, tokens, data) -> str:
        try:
            self._write_block_bytes(block_id, data)
        except BaseException:
            self._release([block_id])
            raise
        return self._publish_received(block_id, parent, key, full, tokens, data)

    def _publish_received(self, block_id: int, parent, key, full: bool, tokens: np.ndarray, data) -> str:
        """A held block whose bytes are written and verified: published if it may be now (a full block whose
        parent was demoted meanwhile is demoted too), and released either way (published: evictable; otherwise
        freed, never seen). Returns "stored" or admit_block's verdict."""
        with self._lock:
            try:
                self._check_not_purged()
                verdict = self._admit_locked(parent, key, full, tokens)
                if verdict == "ok":
                    self._blocks.publish_chain([block_id], parent, tokens, [key if full else None])
                elif verdict == "lower":
                    verdict = "ok" if self._demote_received(parent, key, tokens, data) == "stored" else verdict
            finally:
                self._blocks.release([block_id])
        return "stored" if verdict == "ok" else verdict

    def can_receive_in_place(self) -> bool:
        """A host pool without scales or tiers: received bytes can land straight in a device block."""
        return self.scales is None and self.pool.device.type == "cpu" and self._tiers is None

    def receive_block_in_place(
        self, parent, key, full: bool, tokens: np.ndarray, checksum: int, fill
    ) -> tuple[str, bool]:
        """The direct receive (can_receive_in_place): read one block's bytes with `fill(view)` straight into a
        freshly allocated (held, unpublished) block, published only if its checksum matches (else freed unseen).
        Returns (verdict, whether the bytes were read): a block refused before its bytes are read leaves them to
        the caller to drain."""
        with self._lock:
            self._check_not_purged()
            verdict = self._admit_locked(parent, key, full, tokens)
            ids = self._blocks.allocate(1) if verdict == "ok" else []
        if not ids:
            return (verdict if verdict != "ok" else "full"), False
        block_id = ids[0]
        try:
            view = memoryview(self.pool[block_id].view(-1).view(torch.uint8).numpy())
            fill(view)
            matches = block_checksum(view) == int(checksum)
        except BaseException:
            self._release(ids)
            raise
        if not matches:
            self._release(ids)  # freed unseen
            return "checksum", True
        return self._publish_received(block_id, parent, key, full, tokens, view), True

    def _promote_parent(self, parent: bytes) -> None:
        """A partial tail lives on the device only: bring its parent's chain up from the lower tiers if needed."""
        with self._lock:
            if parent == self.root_hash or parent in self._blocks.cached_hash_to_block:
                return
            tokens = self._chain_tokens(parent)
        if tokens is not None:
            self._promote(tokens, self._hasher.block_chain(tokens))

    def _chain_tokens(self, key: bytes) -> np.ndarray | None:
        """Under the lock: the tokens of the prefix ending with full block `key` (device or lineage), or None."""
        blocks, lineage, root, parts = self._blocks, self._tiers.lineage, self.root_hash, []
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

    def _demote_received(self, parent: bytes, key: bytes, tokens: np.ndarray, data) -> str:
        """Under the lock: keep a verified full block whose parent is only in a lower tier there too."""
        self._tiers.demote(bytes(key), bytearray(data), (bytes(parent), tokens))
        return "stored"

    def _write_block_bytes(self, block_id: int, data: memoryview) -> None:
        pool_bytes = self.pool[0].nbytes
        raw = torch.frombuffer(bytearray(data) if data.readonly else data, dtype=torch.uint8)
        self.pool[block_id].view(-1).view(torch.uint8).copy_(raw[:pool_bytes])
        if self.scales is not None:
            self.scales[block_id].view(-1).view(torch.uint8).copy_(raw[pool_bytes:])
