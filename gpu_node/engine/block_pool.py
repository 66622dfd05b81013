"""Block metadata of one cache: allocation, reference counts, the prefix index and LRU eviction.

The bytes live in one preallocated tensor owned by PagedKVCache; this class owns everything *about* the blocks and is
the only code that changes reference counts, the free stack, the LRU queue or the index. It is not thread-safe: the
cache calls it under its lock.

Every block is in exactly one of these states (checked by `check_invariants`):

    state     ref_cnt  where                        cached (block_parent set)
    free      0        _free_stack                  no
    evictable 0        _evictable (LRU order)       yes: reachable from the root through the index
    held      > 0      nowhere (a reader or writer)  yes (pinned), or no (being written, or doomed)

- A *held, uncached* block is either being written by a put (it becomes cached at commit) or *doomed*: deleted or
  cascaded out of the index while a reader held it; it is freed when the last holder releases it.
- Full blocks are named by their chained hash in `cached_hash_to_block`. Every cached block (full or partial) is a
  child of its parent hash in `hash_to_children` (an insertion-ordered set: a dict of ids), which is how removing a
  block also removes everything stored under it, so every cached block stays reachable from the root and resident
  bytes never count orphans. The same children are also filed by (parent, first token) in `children_by_first`:
  partial tails are found by the longest common prefix of their tokens, which only a child starting with the
  segment's first token can have, so a lookup or put compares a handful of candidates, not every prompt ever
  stored under the root.

Eviction order: the free stack first (blocks holding nothing), then `_evictable` from its head: least recently used
first; blocks released together are appended tail-of-chain first, so on ties the tail of a chain is evicted before
its prefix (a prefix is worth more: every longer sequence needs it). `_evictable` is an OrderedDict: a C hash map
plus linked list, so removal from the middle (a hit on a cold block), append and pop-head are O(1) with no Python
object per block; allocation and release work on whole batches of ids.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

import numpy as np

from gpu_node.engine.block_hash import BlockHash

NO_TOKEN = -1
_FEW_BLOCKS = 8  # hold/release of up to this many blocks go element by element (numpy's fixed setup cost)


class IndexListener(Protocol):
    """Told of every full block entering or leaving the index, in order, under the caller's lock (the cache's
    block events, gpu_node/engine/block_events.py)."""

    def stored(self, block_hash: BlockHash, parent: BlockHash, tokens: np.ndarray) -> None: ...

    def removed(self, block_hash: BlockHash) -> None: ...


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, listener: IndexListener | None = None):
        assert num_blocks >= 1 and block_size >= 1
        self.listener = listener
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Holders of each block: readers that pinned it plus a put writing it. Only this class changes it.
        self.ref_cnt = np.zeros(num_blocks, dtype=np.int32)
        # Tokens whose KV is valid in each block (block_size for a full block); readers never read beyond it.
        self.num_filled = np.zeros(num_blocks, dtype=np.int32)
        # The token ids stored in each block (NO_TOKEN beyond num_filled): used to match partial tails.
        self.block_tokens = np.full((num_blocks, block_size), NO_TOKEN, dtype=np.int32)
        # The chained hash naming a full cached block; None for partial, free or uncommitted blocks.
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        # The hash of the prefix a cached block continues (the root for a first block); None when not cached.
        self.block_parent: list[BlockHash | None] = [None] * num_blocks
        self.cached_hash_to_block: dict[BlockHash, int] = {}
        self.hash_to_children: dict[BlockHash, dict[int, None]] = {}
        self.children_by_first: dict[tuple[BlockHash, int], dict[int, None]] = {}  # (parent, first token) -> ids
        # Free blocks as a stack; popping the end hands out low ids first on a fresh pool.
        self._free_stack: list[int] = list(range(num_blocks - 1, -1, -1))
        # Cached blocks nobody holds, least recently used first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.num_evictions = 0  # cached blocks removed by allocate: evicted ones and everything cascaded with them

    # ---- counts -------------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks holding nothing."""
        return len(self._free_stack)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation can get now: free plus evictable."""
        return len(self._free_stack) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks holding data: cached, being written, or doomed but still read."""
        return self.num_blocks - len(self._free_stack)

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(children) for children in self.hash_to_children.values())

    def is_cached(self, block_id: int) -> bool:
        return self.block_parent[block_id] is not None

    # ---- allocation and holding ---------------------------------------------------------------------------------
    def allocate(self, num_wanted: int, evicted: list | None = None) -> list[int]:
        """Up to `num_wanted` blocks for a writer (fewer only when free + evictable run out), each with ref_cnt 1.

        Takes free blocks first and evicts only under pressure, LRU first. `evicted`, when given, receives
        (block id, hash, parent hash) of every full block the evictions remove (cascaded descendants included),
        whose bytes and block_tokens row stay intact until the caller writes the blocks: so it can demote them.
        """
        free_stack = self._free_stack
        taken = free_stack[: -num_wanted - 1 : -1] if num_wanted else []  # top of the stack first
        del free_stack[len(free_stack) - len(taken) :]
        evictable, uncache = self._evictable, self._uncache
        while len(taken) < num_wanted:
            if free_stack:  # an eviction's cascade may have freed descendants
                taken.append(free_stack.pop())
            elif evictable:
                block_id = evictable.popitem(last=False)[0]
                if evicted is not None:
                    self._note_evicted(block_id, evicted)
                self.num_evictions += uncache(block_id)  # the block and every block cascaded with it
                taken.append(block_id)
            else:
                break
        if taken:
            ids = np.asarray(taken, dtype=np.int64)
            assert not self.ref_cnt[ids].any(), "allocated a held block"
            self.ref_cnt[ids] = 1
            self.num_filled[ids] = 0
        return taken

    def _note_evicted(self, block_id: int, evicted: list) -> None:
        """Record (id, hash, parent) of an evicted full block and of every full block cached under it (the cascade
        the eviction takes out): all still hold their bytes and tokens until the allocating writer writes, so the
        cache demotes the whole subtree instead of dropping its descendants."""
        stack = [block_id]
        while stack:
            current = stack.pop()
            block_hash = self.block_hash[current]
            if block_hash is not None:
                evicted.append((current, block_hash, self.block_parent[current]))
                stack.extend(self.hash_to_children.get(block_hash, ()))

    def hold(self, block_ids: list[int]) -> None:
        """Add a holder to each block (distinct ids); cached blocks leave the evictable queue while held."""
        evictable = self._evictable
        for block_id in block_ids:
            if block_id in evictable:
                del evictable[block_id]
        if len(block_ids) <= _FEW_BLOCKS:
            ref_cnt = self.ref_cnt
            for block_id in block_ids:
                ref_cnt[block_id] += 1
        else:
            self.ref_cnt[np.asarray(block_ids, dtype=np.int64)] += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop a holder from each block (distinct ids). Pass a chain tail first: that order is the eviction order.

        Blocks nobody holds any more become evictable when cached, free otherwise (doomed or never committed).
        """
        if not block_ids:
            return
        if len(block_ids) <= _FEW_BLOCKS:  # a small request's blocks: element by element beats numpy's set-up
            self._release_few(block_ids)
            return
        ids = np.asarray(block_ids, dtype=np.int64)
        assert (self.ref_cnt[ids] > 0).all(), "released a block nobody holds"
        self.ref_cnt[ids] -= 1
        block_parent, evictable, freed = self.block_parent, self._evictable, []
        for block_id in ids[self.ref_cnt[ids] == 0].tolist():
            if block_parent[block_id] is not None:
                evictable[block_id] = None
            else:
                freed.append(block_id)
        if freed:  # _free for a batch: ref_cnt is 0 and the blocks are uncached, checked above
            self.num_filled[freed] = 0
            self._free_stack.extend(freed)

    def _release_few(self, block_ids: list[int]) -> None:
        ref_cnt, block_parent, evictable = self.ref_cnt, self.block_parent, self._evictable
        for block_id in block_ids:  # distinct ids: checked and decremented one at a time, as the batch path does
            assert ref_cnt[block_id] > 0, "released a block nobody holds"
        for block_id in block_ids:
            left = ref_cnt[block_id] - 1
            ref_cnt[block_id] = left
            if left == 0:
                if block_parent[block_id] is not None:
                    evictable[block_id] = None
                else:
                    self.num_filled[block_id] = 0
                    self._free_stack.append(block_id)

    def touch(self, block_ids: list[int]) -> None:
        """Mark cached, unheld blocks most recently used, in the given order (pass a chain tail first)."""
        evictable = self._evictable
        for block_id in block_ids:
            if block_id in evictable:
                evictable.move_to_end(block_id)

    # ---- the index ----------------------------------------------------------------------------------------------
    def cache_block(self, block_id: int, parent: BlockHash, tokens: np.ndarray, block_hash: BlockHash | None) -> None:
        """Publish one held, fully written block under `parent`; `block_hash` names it when it is full."""
        self.publish_chain([block_id], parent, tokens, [block_hash])

    def publish_chain(
        self, block_ids: list[int], parent: BlockHash, tokens: np.ndarray, hashes: list[BlockHash | None]
    ) -> None:
        """Publish held, fully written blocks as a chain under `parent`: block i holds tokens [i*bs, (i+1)*bs) and
        is named hashes[i] (None only for a partial last block). A block whose hash a concurrent writer published
        first is skipped (it stays unpublished and is freed on release); the chain continues under that hash.
        """
        block_size = self.block_size
        num_blocks = len(block_ids)
        assert num_blocks == len(hashes) and (num_blocks - 1) * block_size < len(tokens) <= num_blocks * block_size
        ids = np.asarray(block_ids, dtype=np.int64)
        assert (self.ref_cnt[ids] > 0).all(), "publishing a block nobody holds"
        rows = np.full(num_blocks * block_size, NO_TOKEN, dtype=np.int32)
        rows[: len(tokens)] = tokens
        self.block_tokens[ids] = rows.reshape(num_blocks, block_size)
        self.num_filled[ids] = block_size
        self.num_filled[ids[-1]] = len(tokens) - (num_blocks - 1) * block_size
        block_parent, index, hash_to_children = self.block_parent, self.cached_hash_to_block, self.hash_to_children
        for position, (block_id, block_hash) in enumerate(zip(block_ids, hashes)):
            assert block_parent[block_id] is None, "publishing a cached block"
            if block_hash is None or block_hash not in index:
                block_parent[block_id] = parent
                hash_to_children.setdefault(parent, {})[block_id] = None
                self.children_by_first.setdefault((parent, int(self.block_tokens[block_id, 0])), {})[block_id] = None
                if block_hash is not None:
                    self.block_hash[block_id] = block_hash
                    index[block_hash] = block_id
                    if self.listener is not None:
                        self.listener.stored(block_hash, parent, self.block_tokens[block_id])
            if block_hash is None:
                assert position == num_blocks - 1, "only a partial last block has no hash"
                break
            parent = block_hash

    def extend_block(self, block_id: int, tokens: np.ndarray, block_hash: BlockHash | None) -> None:
        """Publish more tokens in a cached partial block a writer filled in place (its first tokens are unchanged)."""
        assert self.ref_cnt[block_id] > 0 and self.block_parent[block_id] is not None
        assert self.block_hash[block_id] is None and len(tokens) > self.num_filled[block_id]
        self._set_tokens(block_id, tokens)
        if block_hash is not None and block_hash not in self.cached_hash_to_block:
            self.block_hash[block_id] = block_hash
            self.cached_hash_to_block[block_hash] = block_id
            if self.listener is not None:
                self.listener.stored(block_hash, self._parent_of(block_id), self.block_tokens[block_id])

    def _set_tokens(self, block_id: int, tokens: np.ndarray) -> None:
        num_tokens = len(tokens)
        self.block_tokens[block_id, :num_tokens] = tokens
        self.block_tokens[block_id, num_tokens:] = NO_TOKEN
        self.num_filled[block_id] = num_tokens

    def cached_run(self, chain) -> int:
        """How many leading hashes of `chain` (a list of hashes or a BlockChain) are cached, in O(log n) probes.

        Cached chains are prefix closed (a cached full block's parent is cached: check_invariants), so presence along
        a chain is monotone and a binary search finds its end; a full hit costs one probe."""
        index, num_hashes = self.cached_hash_to_block, len(chain)
        if num_hashes == 0 or chain[num_hashes - 1] in index:
            return num_hashes
        low, high = 0, num_hashes - 1  # the first `low` are cached; hash number `high` (0-based) is not
        while low < high:
            middle = (low + high + 1) // 2
            if chain[middle - 1] in index:
                low = middle
            else:
                high = middle - 1
        return low

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        return self.cached_hash_to_block.get(block_hash)

    def children(self, parent: BlockHash) -> list[int]:
        return list(self.hash_to_children.get(parent, ()))

    def best_child(self, parent: BlockHash, segment: np.ndarray) -> tuple[int, int]:
        """The cached child of `parent` whose tokens share the longest prefix with `segment`: (id, length) or (-1, 0).

        One matching rule for reads (partial tails) and writes (reuse, extend, copy-on-write). Only children that
        start with the segment's first token can share anything with it (`children_by_first`).
        """
        if not len(segment):
            return -1, 0
        children = self.children_by_first.get((parent, int(segment[0])))
        if not children:
            return -1, 0
        ids = np.fromiter(children, dtype=np.int64, count=len(children))
        equal = self.block_tokens[ids, : len(segment)] == segment  # NO_TOKEN beyond num_filled never matches
        common = np.where(equal.all(axis=1), len(segment), equal.argmin(axis=1))
        best = int(common.argmax())
        return int(ids[best]), int(common[best])

    def uncache(self, block_ids: list[int], removed_hashes: list[BlockHash] | None = None) -> int:
        """Remove blocks and everything stored under them from the index; returns how many blocks that removed.

        Unheld ones are freed now; held ones are doomed: readers keep their bytes until they release them.
        `removed_hashes`, when given, receives the hash of every full block removed (so lower tiers can follow).
        """
        num_removed = 0
        for block_id in block_ids:
            if self.block_parent[block_id] is None:
                continue
            num_removed += self._uncache(block_id, removed_hashes)
            if self.ref_cnt[block_id] == 0:
                del self._evictable[block_id]
                self._free(block_id)
        return num_removed

    def _parent_of(self, block_id: int) -> BlockHash:
        """The parent of a cached block (a cached block always has one: the root at least)."""
        parent = self.block_parent[block_id]
        assert parent is not None, "a cached block without a parent"
        return parent

    def _uncache(self, block_id: int, removed_hashes: list[BlockHash] | None = None) -> int:
        """Unlink one cached block and everything cached under it, freeing unheld descendants (the block itself is
        left to the caller). Iterative: a chain may be 100,000 blocks deep."""
        block_parent, hash_to_children, index = self.block_parent, self.hash_to_children, self.cached_hash_to_block
        parent = self._parent_of(block_id)
        siblings = hash_to_children[parent]
        del siblings[block_id]
        if not siblings:
            del hash_to_children[parent]
        num_removed, stack = 0, [block_id]
        while stack:
            current = stack.pop()
            self._unfile_first(self._parent_of(current), current)
            block_parent[current] = None
            num_removed += 1
            block_hash = self.block_hash[current]
            if block_hash is not None:
                self.block_hash[current] = None
                del index[block_hash]
                if self.listener is not None:
                    self.listener.removed(block_hash)
                if removed_hashes is not None:
                    removed_hashes.append(block_hash)
                stack.extend(hash_to_children.pop(block_hash, ()))
            if current != block_id and self.ref_cnt[current] == 0:
                del self._evictable[current]
                self._free(current)
        return num_removed

    def _unfile_first(self, parent: BlockHash, block_id: int) -> None:
        key = (parent, int(self.block_tokens[block_id, 0]))
        filed = self.children_by_first[key]
        del filed[block_id]
        if not filed:
            del self.children_by_first[key]

    def _free(self, block_id: int) -> None:
        assert self.ref_cnt[block_id] == 0 and self.block_parent[block_id] is None
        self.num_filled[block_id] = 0
        self._free_stack.append(block_id)

    # ---- checking -----------------------------------------------------------------------------------------------
    def check_invariants(self, root: BlockHash) -> None:
        """O(num_blocks) audit of the state table in the module docstring (tests call it after every step)."""
        free = set(self._free_stack)
        evictable = set(self._evictable)
        held = set(np.flatnonzero(self.ref_cnt > 0).tolist())
        assert len(free) == len(self._free_stack), "a block is on the free stack twice"
        assert not (free & evictable) and not (free & held) and not (evictable & held)
        assert len(free) + len(evictable) + len(held) == self.num_blocks, "a block is in no state"
        assert (self.ref_cnt >= 0).all()
        for block_id in free:
            assert self.block_parent[block_id] is None and self.block_hash[block_id] is None
        for block_id in evictable:
            assert self.block_parent[block_id] is not None, "an evictable block is not cached"
        num_children = 0
        for parent, children in self.hash_to_children.items():
            assert children, "empty child list kept"
            assert parent == root or parent in self.cached_hash_to_block, "a cached block is unreachable"
            for child in children:
                assert self.block_parent[child] == parent
                assert 0 < self.num_filled[child] <= self.block_size
                num_children += 1
        for block_hash, block_id in self.cached_hash_to_block.items():
            assert self.block_hash[block_id] == block_hash and self.num_filled[block_id] == self.block_size
            assert block_id in self.hash_to_children[self._parent_of(block_id)]
        assert num_children == sum(p is not None for p in self.block_parent)
        num_filed = 0
        for (parent, first), children in self.children_by_first.items():
            assert children, "empty first-token set kept"
            for child in children:
                assert self.block_parent[child] == parent and self.block_tokens[child, 0] == first
                num_filed += 1
        assert num_filed == num_children, "a cached block is not filed by its first token"
