"""The state one attached cache's parts share: the facade (PagedKVCache) and the collaborators it is composed of
(TierMoves, PurgeFence, BlockExchange) each receive this one object in their constructor, and nothing else of one
another's.

Invariants (checked by PagedKVCache.check_invariants):
- every field marked (lock) is read and written with `lock` held;
- `active_io` counts the sections that move pool bytes outside the lock (a put between plan and publish, a read, a
  handle whose kv_views were handed out); `io_idle` is notified when it drops to zero, so a purge can wait for it;
- `purged` is set once (by PurgeFence.wipe) and never cleared: from then on every operation raises CachePurged;
- `removals` grows with every delete, clear and wipe, so a promotion that fetched blocks without the lock knows a
  removal ran meanwhile and re-checks them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from gpu_node.engine.block_hash import BlockChain, BlockHasher
from gpu_node.engine.block_pool import BlockPool
from gpu_node.errors import NOT_FOUND_MESSAGE, NodeError
from kcaas.spec import KVCacheSpec
from kcaas.wire import ErrorCode

if TYPE_CHECKING:
    from gpu_node.tiers.lower_tiers import LowerTiers


class CachePurged(NodeError, RuntimeError):
    """The cache was purged (wipe): its KV is gone and it serves nothing more. Answered `not_found`, as a cache this
    node never had (never zeros, never a hint that it existed)."""

    code = ErrorCode.NOT_FOUND

    def public_message(self) -> str:
        return NOT_FOUND_MESSAGE


@dataclass(slots=True, eq=False)
class CacheState:
    """One cache's shared state (module docstring: who holds it, its invariants)."""

    spec: KVCacheSpec  # the cache's identity and layout
    device: torch.device  # where `pool` (and `scales`) live
    pool: torch.Tensor  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] in the storage dtype
    scales: torch.Tensor | None  # the pool's shape but the last dim, float32; None unless the storage is quantized
    hasher: BlockHasher  # the cache's keyed chained hasher (immutable)
    blocks: BlockPool  # (lock) block metadata: ref counts, the prefix index, LRU
    lock: threading.Lock = field(default_factory=threading.Lock)
    io_idle: threading.Condition = field(init=False)  # on `lock`: notified when active_io drops to zero
    extending: set[int] = field(default_factory=set)  # (lock) partial blocks a put is filling in place right now
    tiers: LowerTiers | None = None  # (lock to attach) the lower tiers, once attached: evicted full blocks go there
    purged: bool = False  # (lock) set once by wipe
    active_io: int = 0  # (lock) open sections moving pool bytes outside the lock
    removals: int = 0  # (lock) delete/clear/wipe count
    pool_bytes: memoryview | None = None  # the pool's bytes for kv_views (host pools only; made on first use)
    num_hit_tokens: int = 0  # (lock) tokens served from the cache by get/acquire
    num_miss_tokens: int = 0  # (lock) tokens asked of get/acquire and not cached
    num_cow_copies: int = 0  # (lock) partial blocks copied before a divergent extension
    num_stored_tokens: int = 0  # (lock) tokens written by puts
    num_served_tokens: int = 0  # (lock) tokens whose KV left in a data-plane answer

    def __post_init__(self) -> None:
        self.io_idle = threading.Condition(self.lock)

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    def lower(self) -> LowerTiers:
        """The attached lower tiers; for code that only runs with tiers attached (it checked `tiers` first).

        Raises AssertionError without tiers: a caller that did not check."""
        assert self.tiers is not None, "a lower-tier operation on a cache without lower tiers"
        return self.tiers

    def check_not_purged(self) -> None:
        """Raises CachePurged once the cache was purged."""
        if self.purged:
            raise CachePurged("this cache was purged: its KV is gone")

    def num_cached_full_blocks(self, chain: BlockChain) -> int:
        """(lock) How many leading hashes of `chain` are cached on the device (BlockPool.cached_run)."""
        return self.blocks.cached_run(chain)

    # ---- sections that move pool bytes outside the lock ------------------------------------------------------------
    def begin_io(self) -> None:
        """Enter a section that moves bytes of the pool (a purge waits for it). Raises CachePurged once purged."""
        with self.lock:
            self.check_not_purged()
            self.active_io += 1

    def end_io(self) -> None:
        with self.lock:
            self.end_io_locked()

    def end_io_locked(self) -> None:
        """(lock) Leave a section; the last one out wakes a waiting purge."""
        assert self.active_io > 0, "ended a section nobody began"
        self.active_io -= 1
        if not self.active_io:
            self.io_idle.notify_all()

    def release(self, block_ids: list[int], *, end_read: bool = False) -> None:
        """Let go of held blocks (in reverse: a chain's tail first), ending a read section when `end_read`."""
        with self.lock:
            self.blocks.release(block_ids[::-1])
            if end_read:
                self.end_io_locked()
