"""Planning a put: for each block position of a sequence, reuse, extend in place, copy on write, or allocate.

For block position i (tokens [start, end), end - start <= block_size) under parent hash p:
- REUSE  a cached block holds these tokens already (full: by hash; partial: a child of p whose stored tokens
         begin with them) — deduplicated, nothing written;
- EXTEND a cached partial child of p holds a strict prefix of them and nothing after it: the new tokens go into its
         free slots in place (no other sequence reads those slots: readers stop at their own length);
- COW    a cached child of p shares a prefix with them but then holds *other* tokens (two sequences that shared a
         partial block and diverged), or another put is extending it right now: copy the block, then write the
         divergent slots into the copy — the original stays exactly what its readers were promised;
- NEW    nothing shares a prefix: a fresh block.
Positions after a NEW/EXTEND/COW block have an unpublished parent, so they are NEW.

The planner holds every block the put will touch (reused, extended, copy sources) before allocating, so the
allocation's evictions cannot take them; when blocks run out the plan is cut at the first position without a block
and the held blocks beyond the cut are released: the put stores a prefix and says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gpu_node.block_hash import BlockHash, BlockHasher
from gpu_node.block_pool import BlockPool


@dataclass(slots=True)
class BlockWrite:
    REUSE = "reuse"
    EXTEND = "extend"
    COW = "cow"
    NEW = "new"

    kind: str
    block_id: int  # -1 until allocation for COW/NEW
    parent: BlockHash  # hash of the prefix this block continues
    block_hash: BlockHash | None  # the block's own chained hash when the segment is a full block
    start: int  # sequence index of the block's first token
    end: int  # one past the last token of this sequence in the block
    first_new: int  # first token this put writes into the block (== end when nothing is written)


@dataclass(slots=True)
class PutPlan:
    writes: list[BlockWrite] = field(default_factory=list)  # chain order
    cow_sources: list[int] = field(default_factory=list)  # held until publish
    cow_targets: list[int] = field(default_factory=list)
    num_new_blocks: int = 0
    out_of_space: bool = False

    @property
    def num_cow_copies(self) -> int:
        return len(self.cow_sources)

    @property
    def num_written_tokens(self) -> int:
        return sum(w.end - w.first_new for w in self.writes)

    def slot_mapping(self, block_size: int) -> tuple[int, np.ndarray]:
        """(first token written, slots for tokens [first, end of plan)); -1 marks tokens not written."""
        written = [w for w in self.writes if w.end > w.first_new]
        first, last = written[0].first_new, self.writes[-1].end
        slots = np.full(last - first, -1, dtype=np.int64)
        for w in written:
            base = w.block_id * block_size - w.start
            slots[w.first_new - first : w.end - first] = np.arange(base + w.first_new, base + w.end)
        return first, slots


def plan_put(blocks: BlockPool, hasher: BlockHasher, tokens: np.ndarray, extending: set[int]) -> PutPlan:
    """Plan (and hold the blocks of) a put of `tokens`; call under the cache lock. `extending` is updated."""
    block_size = blocks.block_size
    hashes = hasher.block_hashes(tokens)
    plan = PutPlan()
    parent, parent_cached = hasher.root, True
    for index, start in enumerate(range(0, len(tokens), block_size)):
        end = min(start + block_size, len(tokens))
        block_hash = hashes[index] if end - start == block_size else None
        write = BlockWrite(BlockWrite.NEW, -1, parent, block_hash, start, end, start)
        if parent_cached:
            _place(blocks, write, tokens[start:end], extending)
        if write.kind == BlockWrite.COW:
            plan.cow_sources.append(write.block_id)
            write.block_id = -1
        plan.writes.append(write)
        parent, parent_cached = block_hash, write.kind == BlockWrite.REUSE and block_hash is not None
    blocks.hold([w.block_id for w in plan.writes if w.block_id >= 0] + plan.cow_sources)
    _allocate(blocks, plan, extending)
    return plan


def _place(blocks: BlockPool, write: BlockWrite, segment: np.ndarray, extending: set[int]) -> None:
    if write.block_hash is not None:
        cached = blocks.get_cached_block(write.block_hash)
        if cached is not None:
            write.kind, write.block_id, write.first_new = BlockWrite.REUSE, cached, write.end
            return
    child, common = blocks.best_child(write.parent, segment)
    if common == 0:
        return
    if common == len(segment):
        if write.block_hash is None:  # a full match of a full segment is a hash hit, handled above
            write.kind, write.block_id, write.first_new = BlockWrite.REUSE, child, write.end
        return
    write.first_new = write.start + common
    if common == blocks.num_filled[child] and child not in extending:
        extending.add(child)
        write.kind, write.block_id = BlockWrite.EXTEND, child
    else:
        write.kind, write.block_id = BlockWrite.COW, child  # block_id is the copy source until allocation


def _allocate(blocks: BlockPool, plan: PutPlan, extending: set[int]) -> None:
    needy = [w for w in plan.writes if w.block_id < 0]
    allocated = blocks.allocate(len(needy))
    plan.num_new_blocks = len(allocated)
    cow_index = 0
    cut = len(plan.writes)
    for write, block_id in zip(needy, allocated):
        write.block_id = block_id
    for index, write in enumerate(plan.writes):
        if write.block_id < 0:
            cut = index
            break
        if write.kind == BlockWrite.COW:
            plan.cow_targets.append(write.block_id)
            cow_index += 1
    if cut == len(plan.writes):
        return
    plan.out_of_space = True
    dropped = plan.writes[cut:]
    plan.writes = plan.writes[:cut]
    sources_dropped = plan.cow_sources[cow_index:]
    plan.cow_sources = plan.cow_sources[:cow_index]
    extending.difference_update(w.block_id for w in dropped if w.kind == BlockWrite.EXTEND)
    blocks.release([w.block_id for w in reversed(dropped) if w.block_id >= 0] + sources_dropped)
