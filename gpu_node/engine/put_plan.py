"""Planning a put: reuse the cached prefix, then extend / copy-on-write / allocate the first block to write, then
allocate the rest in bulk.

Walking a sequence's block positions under their parent hashes, a put meets, in this order:
1. REUSE positions — the cached prefix: full blocks found by hash, and possibly a cached partial tail that already
   holds the sequence's last tokens. Deduplicated, nothing written.
2. At most one *head* position, the first that is not cached, which is one of
   - EXTEND: a cached partial child of the parent holds a strict prefix of the position's tokens and nothing after
     it: the new tokens go into its free slots in place (readers stop at their own length, so none is disturbed);
   - COW: a cached child shares a prefix but then holds *other* tokens (two sequences shared a partial block and
     diverged), or another put is extending it now: copy it, then write the divergent slots into the copy — the
     original stays exactly what its readers were promised;
   - NEW: nothing shares a prefix.
3. Every later position is NEW: its parent is the head's hash, which is not published yet, so nothing can hang off it.
   These *tail* blocks are allocated, written, and published in bulk (vectorised, no per-block objects).

The planner holds every block the put touches (reused, extended, the copy source) before allocating, so the
allocation's evictions cannot take them. When blocks run out the plan is cut at the first position without a block:
the put stores a prefix and says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpu_node.engine.block_hash import BlockHash
from gpu_node.engine.block_pool import BlockPool
from gpu_node.errors import NodeError
from kcaas.wire import ErrorCode

REUSE, EXTEND, COW, NEW = "reuse", "extend", "cow", "new"


class PrefixNotCached(NodeError, LookupError):
    """A continued put (start > 0) whose tokens[:start] the cache does not hold: the KV it carries cannot hang off
    anything. Nothing was planned or stored; `num_cached` is how many leading tokens the cache does hold."""

    code = ErrorCode.PREFIX_NOT_CACHED

    def __init__(self, start: int, num_cached: int):
        super().__init__(f"tokens[:{start}] are not cached (the cache holds {num_cached})")
        self.start, self.num_cached = start, num_cached

    def details(self) -> dict[str, Any]:
        return {"num_cached": self.num_cached}


@dataclass(slots=True)
class HeadWrite:
    kind: str  # EXTEND, COW or NEW
    position: int  # block position in the sequence
    block_id: int  # the extended block, else the allocated one (-1 until allocation)
    first_new: int  # first token this put writes into it (sequence index)
    cow_source: int = -1  # the block copied, for COW


@dataclass(slots=True)
class PutPlan:
    num_tokens: int
    block_size: int
    parent: BlockHash  # parent hash of position 0 (the root)
    hashes: list[BlockHash]  # chained hashes of every full block of the sequence
    reused_ids: list[int] = field(default_factory=list)  # positions 0..len-1
    head: HeadWrite | None = None
    tail_ids: list[int] = field(default_factory=list)  # positions head.position+1 .. in order
    num_new_blocks: int = 0
    out_of_space: bool = False

    @property
    def num_positions(self) -> int:
        return len(self.reused_ids) + (self.head is not None) + len(self.tail_ids)

    @property
    def end(self) -> int:
        """One past the last token the plan covers (num_tokens unless cut for space)."""
        return min(self.num_tokens, self.num_positions * self.block_size)

    @property
    def num_written_tokens(self) -> int:
        return self.end - self.head.first_new if self.head is not None else 0

    @property
    def num_cow_copies(self) -> int:
        return int(self.head is not None and self.head.kind == COW)

    def held_ids(self) -> list[int]:
        """Every block the plan holds, tail of the chain first (the order release makes them evictable in): the
        copy-on-write source is a leaf under the last reused block, so it goes before the reused prefix."""
        head = [] if self.head is None or self.head.block_id < 0 else [self.head.block_id]
        source = [self.head.cow_source] if self.head is not None and self.head.kind == COW else []
        return self.tail_ids[::-1] + head + source + self.reused_ids[::-1]

    def slot_mapping(self) -> tuple[int, np.ndarray]:
        """(first token written, int64 slots of tokens [first, end)); call only when num_written_tokens > 0."""
        head, bs = self.head, self.block_size
        assert head is not None, "slot_mapping is for a plan that writes (num_written_tokens > 0)"
        head_end = min(self.num_tokens, (head.position + 1) * bs)
        base = head.block_id * bs - head.position * bs
        head_slots = np.arange(base + head.first_new, base + head_end, dtype=np.int64)
        if not self.tail_ids:
            return head.first_new, head_slots
        tail = (np.asarray(self.tail_ids, dtype=np.int64)[:, None] * bs + np.arange(bs)).reshape(-1)
        return head.first_new, np.concatenate([head_slots, tail[: self.end - head_end]])

    def position_tokens(self, tokens: np.ndarray, position: int) -> np.ndarray:
        return tokens[position * self.block_size : min(self.num_tokens, (position + 1) * self.block_size)]

    def position_hash(self, position: int) -> BlockHash | None:
        return self.hashes[position] if position < len(self.hashes) else None

    def position_parent(self, position: int) -> BlockHash:
        return self.hashes[position - 1] if position else self.parent


def plan_put(
    blocks: BlockPool,
    hashes: list[BlockHash],
    root: BlockHash,
    tokens: np.ndarray,
    extending: set[int],
    evicted: list | None = None,
    start: int = 0,
):
    """Plan (and hold the blocks of) a put of `tokens`; call under the cache lock. `extending` is updated;
    `evicted` receives what the allocation evicts (BlockPool.allocate). `start`: the put carries the KV of
    tokens[start:] only, so a plan that would write before it raises PrefixNotCached — before anything is held,
    allocated or evicted."""
    plan = PutPlan(len(tokens), blocks.block_size, root, hashes)
    num_positions = -(-len(tokens) // blocks.block_size)
    position = blocks.cached_run(hashes)  # no Python step per reused block: a long put's frames reuse thousands
    index = blocks.cached_hash_to_block
    plan.reused_ids = [index[h] for h in hashes[:position]]
    if position < num_positions:
        segment = plan.position_tokens(tokens, position)
        child, common = blocks.best_child(plan.position_parent(position), segment)
        if common == len(segment) and plan.position_hash(position) is None:
            plan.reused_ids.append(child)  # a cached partial tail already holds the sequence's last tokens
        else:
            plan.head = _head_write(blocks, position, segment, child, common, extending)
            if plan.head.first_new < start:  # tokens[:start] are not all cached: nothing held yet, nothing to undo
                if plan.head.kind == EXTEND:  # but the claim on the extended block
                    extending.discard(plan.head.block_id)
                raise PrefixNotCached(start, plan.head.first_new)
    blocks.hold(plan.held_ids())
    _allocate(blocks, plan, num_positions, evicted)
    return plan


def _head_write(blocks, position, segment, child, common, extending) -> HeadWrite:
    start = position * blocks.block_size
    if common == 0 or common == len(segment):  # no shared prefix (a full-length match of a full block is a hash hit)
        return HeadWrite(NEW, position, -1, start)
    if common == blocks.num_filled[child] and child not in extending:
        extending.add(child)
        return HeadWrite(EXTEND, position, child, start + common)
    return HeadWrite(COW, position, -1, start + common, cow_source=child)


def _allocate(blocks: BlockPool, plan: PutPlan, num_positions: int, evicted: list | None) -> None:
    head = plan.head
    if head is None:
        return
    num_wanted = (head.kind != EXTEND) + num_positions - head.position - 1
    allocated = blocks.allocate(num_wanted, evicted)
    plan.num_new_blocks = len(allocated)
    if head.kind != EXTEND:
        if not allocated:  # not even the head fits: drop it and what it held
            plan.head, plan.out_of_space = None, True
            blocks.release([head.cow_source] if head.kind == COW else [])
            return
        head.block_id = allocated.pop(0)
    plan.tail_ids = allocated
    plan.out_of_space = plan.num_positions < num_positions
