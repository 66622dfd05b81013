"""A cache's block events in vLLM's KV-event format (kcaas.kv_events): which full blocks entered and left its device
pool and each of its lower tiers, numbered, the last `max_bytes` of batches kept for replay. The data plane serves
them to the cache's own tenant (an EVENTS request under the cache's data token, docs/routing.md); nothing here
crosses a tenant boundary: one log per cache.

Invariants:
  * events are recorded in the order the pool's index changed (BlockPool calls `stored` / `removed` under the
    cache's lock), and a batch seals everything recorded before it: a reader that applies batches in seq order
    holds exactly the full blocks the pool indexed;
  * seq numbers start at 0 and grow by one per batch; `read(since)` answers the batches from `since` still kept,
    and `first_seq` tells a reader whose `since` is older that it missed some (then: AllBlocksCleared and resync);
  * a block's event carries its keyed hash (the cache's own names: opaque, never another cache's), its parent's
    (None for the first block of a sequence), its tokens and its medium: GPU (the device pool), CPU (DRAM), STORAGE
    (the SSD tier), NETWORK (the fleet's network store);
  * the device's events are recorded as its index changes; the lower tiers' are announced as differences: at each
    read (`announce_lower`, under the cache lock) what each tier holds now against what was last announced, so a
    reader holds exactly what every tier held at the last read. Lower-tier blocks without lineage (a network block
    no one here stored or fetched) are never announced: a reader could not name their tokens.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from gpu_node.engine.block_hash import BlockHash, BlockLineage
from kcaas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, Event, EventBatch, encode_batch

DEVICE_MEDIUM = "GPU"  # vLLM's name for an engine's device pool; a CPU node's pool is its device pool too
LOWER_MEDIA = {"dram": "CPU", "ssd": "STORAGE", "network": "NETWORK"}  # LowerTiers' tier names -> event media
DEFAULT_MAX_BYTES = 16 << 20  # encoded batches kept for replay, per cache (the oldest go first)
MAX_PENDING_BLOCKS = 4096  # events sealed into a batch as soon as they name this many blocks


@dataclass(frozen=True, slots=True)
class EventsRead:
    first_seq: int  # the oldest batch kept: a reader asking from before it missed batches
    next_seq: int  # the seq the next batch will have
    batches: tuple[tuple[int, bytes], ...]  # (seq, vLLM-format payload) from max(since, first_seq) on


@dataclass(slots=True)
class _Pending:
    """One event being recorded: a run of stored blocks (a chain), a run of removed ones, or a clear."""

    kind: str  # "stored" | "removed" | "cleared"
    hashes: list[bytes]
    parent: bytes | None = None
    tokens: list[int] | None = None
    medium: str = DEVICE_MEDIUM

    def event(self, block_size: int) -> Event:
        if self.kind == "stored":
            assert self.tokens is not None
            return BlockStored(tuple(self.hashes), self.parent, tuple(self.tokens), block_size, self.medium)
        if self.kind == "removed":
            return BlockRemoved(tuple(self.hashes), self.medium)
        return AllBlocksCleared()


class BlockEventLog:
    def __init__(self, block_size: int, root: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES):
        self._block_size, self._root, self._max_bytes = block_size, root, max_bytes
        self._lock = threading.Lock()
        self._pending: list[_Pending] = []
        self._pending_blocks = 0
        self._batches: deque[tuple[int, bytes]] = deque()
        self._bytes = 0
        self._next_seq = 0
        self._announced: dict[str, set[bytes]] = {}  # lower-tier medium -> the blocks readers were told it holds

    # ---- recording (BlockPool, under the cache's lock) --------------------------------------------------------
    def stored(self, block_hash: bytes, parent: bytes, tokens: np.ndarray, medium: str = DEVICE_MEDIUM) -> None:
        """A full block entered the index under `parent` (the cache's root for a sequence's first block)."""
        with self._lock:
            self._stored(bytes(block_hash), parent, tokens, medium)

    def _stored(self, block_hash: bytes, parent: bytes, tokens: np.ndarray, medium: str) -> None:
        parent_hash = None if parent == self._root else bytes(parent)
        last = self._pending[-1] if self._pending else None
        if last is not None and last.kind == "stored" and last.medium == medium and last.hashes[-1] == parent_hash:
            last.hashes.append(block_hash)  # the chain goes on
            last.tokens.extend(tokens.tolist())  # type: ignore[union-attr]
        else:
            self._pending.append(_Pending("stored", [block_hash], parent_hash, tokens.tolist(), medium))
        self._counted()

    def removed(self, block_hash: bytes, medium: str = DEVICE_MEDIUM) -> None:
        """A full block left the index (evicted, deleted, cleared)."""
        with self._lock:
            self._removed(bytes(block_hash), medium)

    def _removed(self, block_hash: bytes, medium: str) -> None:
        last = self._pending[-1] if self._pending else None
        if last is not None and last.kind == "removed" and last.medium == medium:
            last.hashes.append(block_hash)
        else:
            self._pending.append(_Pending("removed", [block_hash], medium=medium))
        self._counted()

    def cleared(self) -> None:
        """Every block left at once (the cache was wiped or purged)."""
        with self._lock:
            self._pending = [_Pending("cleared", [])]
            self._announced = {}
            self._seal()

    def announce_lower(self, held: dict[str, dict[BlockHash, BlockLineage]]) -> None:
        """Under the cache's lock: record what each lower-tier medium gained and lost since the last announcement.
        `held`: medium -> {block hash: (parent hash, tokens)} of the blocks it holds now (LowerTiers.held_by_medium);
        a gained block is announced after its parent when both are new, so chains read in order."""
        with self._lock:
            for medium in set(self._announced) | set(held):
                now, before = held.get(medium, {}), self._announced.get(medium, set())
                for block_hash in before - now.keys():
                    self._removed(block_hash, medium)
                gained = _parents_first(now, now.keys() - before)
                for block_hash in gained:
                    parent, tokens = now[block_hash]
                    self._stored(block_hash, parent, tokens, medium)
                self._announced[medium] = (before & now.keys()) | set(gained)

    def _counted(self) -> None:
        self._pending_blocks += 1
        if self._pending_blocks >= MAX_PENDING_BLOCKS:
            self._seal()

    def _seal(self) -> None:
        if not self._pending:
            return
        batch = EventBatch(time.time(), tuple(p.event(self._block_size) for p in self._pending))
        payload = encode_batch(batch)
        self._batches.append((self._next_seq, payload))
        self._bytes += len(payload)
        self._next_seq += 1
        self._pending, self._pending_blocks = [], 0
        while self._bytes > self._max_bytes and len(self._batches) > 1:
            self._bytes -= len(self._batches.popleft()[1])

    # ---- reading (the data plane) -----------------------------------------------------------------------------
    def read(self, since: int, max_batches: int) -> EventsRead:
        """The batches from `since` (at most `max_batches`), after sealing what is pending."""
        with self._lock:
            self._seal()
            first = self._batches[0][0] if self._batches else self._next_seq
            start = max(since, first)
            batches = tuple((seq, payload) for seq, payload in self._batches if seq >= start)[:max_batches]
            return EventsRead(first, self._next_seq, batches)


def _parents_first(lineage: dict[BlockHash, BlockLineage], blocks: set[BlockHash]) -> list[BlockHash]:
    """`blocks` ordered so a block comes after its parent when both are among them (depth first from each block
    whose parent is not: a chain's blocks stay together, so they read as one BlockStored)."""
    children: dict[BlockHash, list[BlockHash]] = {}
    roots = []
    for block_hash in blocks:
        parent = lineage[block_hash][0]
        if parent in blocks:
            children.setdefault(parent, []).append(block_hash)
        else:
            roots.append(block_hash)
    ordered, stack = [], roots[::-1]
    while stack:
        current = stack.pop()
        ordered.append(current)
        stack.extend(reversed(children.get(current, ())))
    return ordered
