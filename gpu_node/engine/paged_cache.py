"""PagedKVCache: one attached cache — a preallocated block pool on one device, a keyed prefix index, LRU eviction.

Storage layout (one tensor per cache, allocated and pre-faulted at attach):

    pool   [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]   storage dtype
    scales [num_blocks, num_layers, 2, block_size, num_kv_heads]             float32, int8/fp8 storage only

Block-major, so one block (every layer, K and V) is one contiguous run of bytes: a tier copy, a checksum or a
migration frame is one memcpy per block. Inside a block each (layer, K/V) is [block_size, heads, head_dim] — the NHD
layout vLLM and FlashInfer page in — so `pool[:, layer, 0]` is a layer's paged K cache with a block stride of
num_layers*2*block_size*heads*head_dim elements, read in place by paged attention (kcaas_kernels/paged_attention.py).

Engines hand KV over as [num_layers, 2, num_tokens, num_kv_heads, head_dim] in their dtype and get the same back.

Concurrency and visibility: metadata changes happen under one lock; bytes move outside it. A put plans under the
lock (which blocks it reuses, extends in place, copies on write, or allocates), holds every block it touches, writes
without the lock, then publishes under the lock. Blocks enter the index only at publish and a partial block's
`num_filled` grows only at publish, so readers never see a block (or a slot) before its bytes are fully written.

The facade owns every tier: lower tiers (gpu_node/tiers/lower_tiers.py, attached with attach_tiers) are reached only
through the tier operations of gpu_node/engine/tier_moves.py, so lookup, get/acquire, put, delete, clear and wipe each
reach device, DRAM and SSD alike; migration reaches blocks only through the block exchange of
gpu_node/engine/block_exchange.py. delete and clear forget a prefix and everything chained under it in every tier,
durably.

Purge (wipe) is a fence: once it starts, every operation raises CachePurged; bytes in motion are waited for — a
put's write (then discarded, never published), a read section (read(), or a handle whose kv_views are being sent,
until it is released) — and only then is every byte zeroed, so no reader is ever handed zeros as a hit and nothing
lands in the pool after it was wiped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

import kcaas_kernels
from gpu_node.engine.block_events import BlockEventLog, EventsRead
from gpu_node.engine.block_exchange import BlockExchange
from gpu_node.engine.block_hash import BlockChain, BlockHash, BlockHasher, tokens_as_int32
from gpu_node.engine.block_pool import BlockPool
from gpu_node.engine.cache_state import CachePurged, CacheState
from gpu_node.engine.fence import PurgeFence
from gpu_node.engine.kv_input import check_storable
from gpu_node.engine.put_plan import COW, EXTEND, PrefixNotCached, PutPlan, plan_put
from gpu_node.engine.tier_moves import TierMoves
from gpu_node.tiers.lower_tiers import LowerTiers
from kcaas.spec import KVCacheSpec

TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "fp8_e4m3": torch.float8_e4m3fn,
}


def lookup_probe_stride(num_blocks: int) -> int:
    """How many blocks lookup hashes between two probes of the device index, for a prompt of `num_blocks` full
    blocks: ~sqrt(num_blocks) / 2, within [4, 32].

    A probe (a bytes object, its hash, a dict lookup) costs about a third of hashing a block, more once the index
    outgrows the CPU's caches (bench.engine's lookup_* figures measure both). With stride s a full hit pays num_blocks /
    s probes and a miss is found at most s - 1 blocks late (hashed for nothing); s ~ sqrt(num_blocks) / 2 keeps both
    small: a 4096-token prompt at block size 16 gets s = 8 (32 probes), a 32768-token one s = 22 (94 probes, ~1.5% of
    its hashing).
    """
    return min(32, max(4, math.isqrt(num_blocks) // 2))


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _allocate_storage(
    spec: KVCacheSpec, num_blocks: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The pool [num_blocks, num_layers, 2, block_size, heads, dim] in the storage dtype, and the scales (quantized
    storage only), zeroed now: the first touch of fresh pages costs more than a warm copy (bench.engine's
    get_fresh_out) and would land on the first puts."""
    shape = (num_blocks, spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
    pool = torch.zeros(shape, dtype=TORCH_DTYPES[spec.storage_dtype], device=device)
    scales = torch.ones(shape[:-1], dtype=torch.float32, device=device) if spec.is_quantized else None
    return pool, scales


@dataclass(frozen=True, slots=True)
class PutResult:
    num_tokens: int  # tokens in the request
    num_cached_tokens: int  # leading tokens cached after the put (== num_tokens unless out_of_space)
    num_written_tokens: int  # tokens whose KV this put wrote (the rest were cached already: deduplicated)
    num_new_blocks: int  # blocks allocated (new blocks and copy-on-write copies)
    num_cow_copies: int  # partial blocks copied before a divergent extension
    out_of_space: bool  # every other block is held by readers: only a prefix (maybe none) was stored


@dataclass(frozen=True, slots=True)
class CacheStats:
    num_blocks: int
    num_used_blocks: int  # blocks holding data (cached, being written, or held by a reader after deletion)
    num_free_blocks: int  # blocks holding nothing
    num_cached_blocks: int  # blocks readers can find
    num_hit_tokens: int  # tokens served from cache by get/acquire
    num_miss_tokens: int  # tokens asked of get/acquire and not cached
    num_evictions: int  # cached blocks reclaimed under pressure
    num_cow_copies: int
    num_stored_tokens: int  # tokens written by puts
    block_bytes: int
    bytes_resident: int  # used blocks x block bytes: what billing integrates over time
    bytes_capacity: int
    num_served_tokens: int = 0  # tokens whose KV the data plane sent in GET answers (count_served): billed reads


@dataclass(slots=True)
class PrefixHandle:
    """The longest cached prefix of a sequence, held so its blocks cannot be evicted or reused while it is read.

    `block_ids` are in chain order; the last one may be partially used (num_tokens need not be a block multiple).
    Release exactly once (or use as a context manager).
    """

    cache: PagedKVCache
    num_tokens: int
    block_ids: list[int]
    released: bool = field(default=False)
    reading: bool = field(default=False)  # inside a read section (kv_views handed out): a purge waits for release

    def slot_mapping(self) -> torch.Tensor:
        """The pool slots of the held tokens, in order. Raises CachePurged once the cache was purged."""
        return self.cache.slots_of(self)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.cache.release(self)

    def __enter__(self) -> PrefixHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


__all__ = ["CachePurged", "CacheStats", "PagedKVCache", "PrefixHandle", "PrefixNotCached", "PutResult"]


class PagedKVCache:
    """One attached cache (module docstring), composed of parts that share one CacheState: TierMoves (device <->
    lower tiers), PurgeFence (wipe) and BlockExchange (`exchange`: migration's one way in). The facade delegates to
    them and touches no state of theirs."""

    def __init__(
        self,
        spec: KVCacheSpec,
        *,
        hash_key: bytes,
        num_blocks: int | None = None,
        capacity_bytes: int | None = None,
        device: torch.device | str | None = None,
    ):
        if (num_blocks is None) == (capacity_bytes is None):
            raise ValueError("give exactly one of num_blocks and capacity_bytes")
        if num_blocks is None:
            assert capacity_bytes is not None
            num_blocks = capacity_bytes // spec.block_bytes
        if num_blocks < 1:
            raise ValueError(f"capacity holds no block (a block is {spec.block_bytes} bytes)")
        self.spec = spec
        self.device = torch.device(device) if device is not None else default_device()
        self.kv_dtype = TORCH_DTYPES[spec.kv_dtype]
        self.block_size = spec.block_size
        self.pool, self.scales = _allocate_storage(spec, num_blocks, self.device)
        hasher = BlockHasher(hash_key, spec.block_size, spec.model_fingerprint)
        self.events = BlockEventLog(spec.block_size, hasher.root)  # the cache's block events (docs/routing.md)
        self._state = CacheState(
            spec=spec,
            device=self.device,
            pool=self.pool,
            scales=self.scales,
            hasher=hasher,
            blocks=BlockPool(num_blocks, spec.block_size, listener=self.events),
        )
        self._moves = TierMoves(self._state)
        self._fence = PurgeFence(self._state, self._moves)
        self.exchange = BlockExchange(self._state, self._moves)  # what migration reaches the cache's blocks through

    # ---- the parts' public faces ----------------------------------------------------------------------------------
    def attach_tiers(self, tiers: LowerTiers) -> None:
        """Demote evicted full blocks into `tiers` and promote them back on reads."""
        self._moves.attach(tiers)

    @property
    def tiers(self) -> LowerTiers | None:
        """The attached LowerTiers, for reading their figures (resident bytes, failures); moving blocks between
        tiers is the cache's alone."""
        return self._state.tiers

    @property
    def hasher(self) -> BlockHasher:
        """The cache's keyed hasher (the names of its blocks)."""
        return self._state.hasher

    @property
    def purged(self) -> bool:
        """Whether the cache was purged (then every operation raises CachePurged)."""
        return self._state.purged

    def close(self) -> None:
        """Let go of the lower tiers' files without erasing them (warm restart)."""
        self._moves.close()

    def wipe(self, *, wait_seconds: float = 60.0, keep_network: bool = False) -> int:
        """Purge (PurgeFence.wipe): fence, forget, zero every tier. Returns the bytes that were resident."""
        freed = self._fence.wipe(wait_seconds=wait_seconds, keep_network=keep_network)
        self.events.cleared()
        return freed

    def read_events(self, since: int, max_batches: int) -> EventsRead:
        """The cache's block events from batch `since` (BlockEventLog.read), the lower tiers' changes announced."""
        self._moves.announce_lower(self.events)
        return self.events.read(since, max_batches)

    @property
    def zero_copy_reads(self) -> bool:
        """Whether kv_views can hand out the pool's own bytes: plain host memory in the engine dtype."""
        spec = self.spec
        return self.pool.device.type == "cpu" and not spec.is_quantized and spec.storage_dtype == spec.kv_dtype

    # ---- checks -------------------------------------------------------------------------------------------------
    def _check_identity(self, identity: KVCacheSpec | None) -> None:
        if identity is not None:
            self.spec.check_matches(identity)

    def _check_kv(self, kv: torch.Tensor, num_tokens: int) -> None:
        """A put's KV: any strides and device; shape and engine dtype must match; the values must be storable in
        this cache's storage dtype (gpu_node/engine/kv_input.py: no NaN/inf into int8/fp8, no finite value beyond a
        narrower float storage's range), else KVNotStorable (a ValueError) before anything is stored. KV that
        requires grad is taken: storing detaches it (the same values, stored exactly; the pool never requires grad).
        """
        expected = self._kv_shape(num_tokens)
        if not isinstance(kv, torch.Tensor):
            raise TypeError("kv must be a torch.Tensor [num_layers, 2, num_tokens, num_kv_heads, head_dim]")
        if tuple(kv.shape) != expected:
            raise ValueError(
                f"kv has shape {tuple(kv.shape)}, this cache takes {expected} "
                "= [num_layers, 2, num_tokens, num_kv_heads, head_dim]"
            )
        if kv.dtype != self.kv_dtype:
            raise ValueError(f"kv has dtype {kv.dtype}, this cache's engine dtype is {self.kv_dtype}")
        check_storable(kv, self.pool.dtype)

    # ---- reads --------------------------------------------------------------------------------------------------
    def _match(
        self, tokens: np.ndarray, chain: BlockChain, *, want_ids: bool, num_full: int | None = None
    ) -> tuple[int, list[int]]:
        """Longest cached prefix: (num_tokens, block ids in chain order if want_ids). Call under the lock.

        `num_full`, when the caller already knows it: how many leading blocks of `chain` are cached on the device
        (`chain` may then stop past them: it must only name block num_full - 1, the partial tail's parent)."""
        blocks = self._state.blocks
        if num_full is None:
            num_full = self._state.num_cached_full_blocks(chain)
        index = blocks.cached_hash_to_block
        block_ids = [index[h] for h in chain.hashes(0, num_full)] if want_ids else []
        num_tokens = num_full * self.block_size
        tail_id, tail_len = blocks.best_child(chain.parent(num_full), tokens[num_tokens : num_tokens + self.block_size])
        if tail_len:
            block_ids.append(tail_id)
            num_tokens += tail_len
        return num_tokens, block_ids

    def lookup(self, tokens, *, identity: KVCacheSpec | None = None) -> int:
        """How many leading tokens of `tokens` are cached (whole blocks, then the longest matching partial tail;
        with lower tiers, the device's full blocks followed by the lower tiers' run when that is longer).

        A pure query: it neither holds nor touches blocks (get/acquire do).

        Hashes only as far as the cache holds the prompt, so a half hit costs about half a full hit. The chain is
        computed block by block in C, probing the device index every few blocks (lookup_probe_stride), and stops at
        the first block the device lacks (a binary search over the last stride finds it). Early exit relies on the
        device's cached chains being prefix closed (a cached full block's parent is cached, as
        BlockPool.check_invariants checks): past the first block the device lacks, it holds none of the chain. With
        lower tiers, hashing goes on through their run, probing every block (they are not prefix closed), and stops
        at the first block no tier holds. Probes need the index as it is under the lock, and the GIL: both are held
        while hashing (bench.engine: lookup_tokens_per_s_list_input; the full-chain hash of acquire/get/put/delete runs
        without either).

        Returns: the number of leading tokens cached (0: none).
        Raises: IdentityMismatch when `identity` is given and differs from the cache's; CachePurged once purged;
            ValueError for token ids outside [0, 2**31).
        """
        self._check_identity(identity)
        tokens = tokens_as_int32(tokens)
        self._moves.probe_network(tokens)
        with self._state.lock:
            self._state.check_not_purged()
            index = self._state.blocks.cached_hash_to_block
            stride = lookup_probe_stride(len(tokens) // self.block_size)
            chain, num_full = self._state.hasher.held_run(tokens, index, stride=stride)
            num_tokens = self._match(tokens, chain, want_ids=False, num_full=num_full)[0]
            if (
                self._state.tiers is not None
            ):  # a partial tail never holds a whole block: the full blocks are num // size
                num_tokens = max(num_tokens, self._moves.lower_run_end(chain, num_tokens // self.block_size, tokens))
        return num_tokens

    def acquire(self, tokens, *, identity: KVCacheSpec | None = None) -> PrefixHandle:
        """Hold the longest cached prefix of `tokens` (for reading in place, e.g. paged attention); a prefix that
        continues into lower tiers is promoted to the device first.

        Returns: a PrefixHandle holding the prefix (num_tokens 0: nothing cached); release it once.
        Raises: IdentityMismatch when `identity` is given and differs from the cache's; CachePurged once purged;
            ValueError for token ids outside [0, 2**31).
        """
        self._check_identity(identity)
        tokens = tokens_as_int32(tokens)
        chain = self._state.hasher.block_chain(tokens)
        if self._state.tiers is not None:
            self._moves.probe_network(tokens, chain)
            self._moves.promote(tokens, chain)
        with self._state.lock:
            self._state.check_not_purged()
            num_tokens, block_ids = self._match(tokens, chain, want_ids=True)
            self._state.blocks.hold(block_ids)
            self._state.num_hit_tokens += num_tokens
            self._state.num_miss_tokens += len(tokens) - num_tokens
        return PrefixHandle(self, num_tokens, block_ids)

    def kv_views(self, handle: PrefixHandle, start: int, end: int) -> list[memoryview] | None:
        """Byte views into the pool of tokens [start, end) of a held prefix, in the API's layer-major order (for each
        layer, K then V, the tokens in order: one run per block), so a server can send them without copying. Valid
        while the handle is held (held blocks are never evicted or reused, and a put only appends past their
        filled slots). None when the pool is not plain host memory in the engine dtype (quantized storage or a
        device pool): read with get() then.

        Returns: the views, or None when the pool is not plain host memory in the engine dtype.
        Raises: CachePurged once purged.
        """
        spec = self.spec
        if not self.zero_copy_reads:
            return None
        assert 0 <= start <= end <= handle.num_tokens and not handle.released, "a range of a held prefix"
        self._begin_read(handle)  # ends when the handle is released: a purge waits for the views to be sent
        if self._state.pool_bytes is None:
            self._state.pool_bytes = self.pool.view(-1).view(torch.uint8).numpy().data
        token_bytes = spec.num_kv_heads * spec.head_dim * self.pool.element_size()
        run_stride = spec.block_size * token_bytes  # one (block, layer, K|V) run
        block_stride = spec.num_layers * 2 * run_stride
        pool, bs = self._state.pool_bytes, spec.block_size
        spans = []  # (offset of the block, first token, last token + 1) for each block overlapping [start, end)
        for index in range(start // bs, (end + bs - 1) // bs):
            lo, hi = max(start - index * bs, 0), min(end - index * bs, bs)
            spans.append((handle.block_ids[index] * block_stride, lo * token_bytes, hi * token_bytes))
        views = []
        for run in range(spec.num_layers * 2):
            base = run * run_stride
            for block_offset, lo, hi in spans:
                at = block_offset + base
                views.append(pool[at + lo : at + hi])
        return views

    def get(
        self, tokens, *, identity: KVCacheSpec | None = None, out: torch.Tensor | None = None
    ) -> tuple[int, torch.Tensor]:
        """(n, kv) for the longest cached prefix: kv is [num_layers, 2, n, num_kv_heads, head_dim] in the engine dtype.

        `out`: an optional reusable staging buffer (contiguous, engine dtype, on the cache's device, at least
        len(tokens) tokens of KV); kv is then a view into it and no memory is allocated (fresh pages cost far more
        than the copy itself).

        Returns: (n, kv); n is 0 and kv empty on a miss.
        Raises: IdentityMismatch when `identity` is given and differs from the cache's; CachePurged once purged;
            ValueError for token ids outside [0, 2**31). ValueError for an unusable `out`.
        """
        tokens = tokens_as_int32(tokens)
        if out is not None:
            self._check_staging(out, len(tokens))
        with self.acquire(tokens, identity=identity) as handle:
            kv = self.read(handle, out=out)
        return handle.num_tokens, kv

    def read(self, handle: PrefixHandle, num_tokens: int | None = None, *, out: torch.Tensor | None = None):
        """The KV of the first `num_tokens` (default all) tokens of a held prefix, [num_layers, 2, n, heads, dim] in
        the engine dtype; into `out` (a staging buffer, as get's) when given.

        Returns: the KV, a view into `out` when given.
        Raises: CachePurged once purged; ValueError for an unusable `out`.
        """
        n = handle.num_tokens if num_tokens is None else num_tokens
        assert 0 <= n <= handle.num_tokens and not handle.released, "a range of a held prefix"
        view = None
        if out is not None:
            self._check_staging(out, n)
            view = out.view(-1)[: n * self.spec.elements_per_token].view(self._kv_shape(n))
        slots = self._slots_for(handle.block_ids, n)
        section = not handle.reading
        if section:
            self._state.begin_io()
        try:
            return kcaas_kernels.read_kv(self.pool, self.scales, slots, out_dtype=self.kv_dtype, out=view)
        finally:
            if section:
                self._state.end_io()

    def _begin_read(self, handle: PrefixHandle) -> None:
        """Open the handle's read section (kv_views handed out) once; it ends when the handle is released."""
        if not handle.reading:
            self._state.begin_io()
            handle.reading = True

    def slots_of(self, handle: PrefixHandle) -> torch.Tensor:
        """The pool slots of a held prefix's tokens. Raises CachePurged once the cache was purged."""
        self._state.check_not_purged()
        return self._slots_for(handle.block_ids, handle.num_tokens)

    def release(self, handle: PrefixHandle) -> None:
        """Let go of a held prefix (PrefixHandle.release calls it, once), ending its read section if it had one."""
        self._state.release(handle.block_ids, end_read=handle.reading)

    def _kv_shape(self, num_tokens: int) -> tuple[int, ...]:
        spec = self.spec
        return (spec.num_layers, 2, num_tokens, spec.num_kv_heads, spec.head_dim)

    def _check_staging(self, out: torch.Tensor, num_tokens: int) -> None:
        if not isinstance(out, torch.Tensor) or out.dtype != self.kv_dtype or out.device != self.device:
            raise ValueError(f"out must be a {self.kv_dtype} tensor on {self.device}")
        if not out.is_contiguous() or out.numel() < num_tokens * self.spec.elements_per_token:
            raise ValueError(f"out must be contiguous with room for {num_tokens} tokens of KV")

    def _slots_for(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        ids = torch.as_tensor(block_ids, dtype=torch.int64)
        slots = (ids[:, None] * self.block_size + torch.arange(self.block_size)).reshape(-1)[:num_tokens]
        return slots.to(self.device)

    # ---- writes -------------------------------------------------------------------------------------------------
    def put(self, tokens, kv: torch.Tensor, *, identity: KVCacheSpec | None = None, start: int = 0) -> PutResult:
        """Store the KV of `tokens`; blocks already cached are deduplicated, not rewritten.

        `start`: kv covers tokens[start:] only ([num_layers, 2, len(tokens) - start, heads, dim]) and the cache must
        already hold tokens[:start] — a continuation (the next frame of a long put, a connector saving the suffix it
        computed): the new blocks are appended after the cached prefix, which is neither read back nor rewritten.
        When the cache does not hold all of tokens[:start] (evicted or deleted meanwhile), PrefixNotCached and
        nothing is stored.

        kv may require grad: it is stored detached (the same values). KV the storage cannot hold exactly (non-finite
        values into int8/fp8, values beyond a narrower storage dtype's range) raises KVNotStorable (a ValueError)
        before anything is stored.

        Returns: a PutResult (out_of_space: only a prefix, maybe none, was stored: readers hold the rest).
        Raises: IdentityMismatch when `identity` is given and differs from the cache's; CachePurged once purged;
            ValueError for token ids outside [0, 2**31), TypeError/ValueError for kv of another shape or dtype;
            KVNotStorable; PrefixNotCached (with `start`).
        """
        self._check_identity(identity)
        tokens = tokens_as_int32(tokens)
        if not 0 <= start <= len(tokens):
            raise ValueError(f"start must lie in [0, {len(tokens)}], got {start}")
        self._check_kv(kv, len(tokens) - start)
        hashes = self._state.hasher.block_hashes(tokens)
        with self._state.lock:
            self._state.check_not_purged()
            evicted: list | None = [] if self._state.tiers is not None else None
            plan = plan_put(
                self._state.blocks,
                hashes,
                self._state.hasher.root,
                tokens,
                self._state.extending,
                evicted=evicted,
                start=start,
            )
            self._state.active_io += 1  # the write below: a purge waits for it, then this put is discarded
            self._moves.demote_evicted(evicted)
        try:
            self._write(plan, kv, start)
        except BaseException:
            with self._state.lock:
                self._release_plan(plan)
                self._state.end_io_locked()
            raise
        with self._state.lock:
            try:
                self._state.check_not_purged()  # purged while the bytes moved: discarded, never published
                num_cached = self._publish(plan, tokens)
            finally:
                self._release_plan(plan)
                self._state.end_io_locked()
            self._state.num_cow_copies += plan.num_cow_copies
            self._state.num_stored_tokens += plan.num_written_tokens
        if self._state.tiers is not None and self._state.tiers.writes_through and num_cached >= self.block_size:
            self._moves.write_through_network(tokens, hashes[: num_cached // self.block_size])
        return PutResult(
            num_tokens=len(tokens),
            num_cached_tokens=num_cached,
            num_written_tokens=plan.num_written_tokens,
            num_new_blocks=plan.num_new_blocks,
            num_cow_copies=plan.num_cow_copies,
            out_of_space=plan.out_of_space,
        )

    def _write(self, plan: PutPlan, kv: torch.Tensor, start: int) -> None:
        """Move the bytes of a plan: the copy-on-write copy first, then one batched write of every new slot (kv
        holds the tokens from `start` on, and the plan writes none before it)."""
        head = plan.head
        if head is not None and head.kind == COW:
            kcaas_kernels.copy_blocks(
                self.pool, self.scales, self.pool, self.scales, [head.cow_source], [head.block_id]
            )
        if plan.num_written_tokens:
            first, slots = plan.slot_mapping()
            assert first >= start, "a plan writing before start was refused (PrefixNotCached)"
            slot_tensor = torch.from_numpy(slots).to(self.device)
            kv_written = kv[:, :, first - start : first - start + len(slots)].to(self.device)
            kcaas_kernels.write_kv(kv_written, self.pool, self.scales, slot_tensor)

    def _publish(self, plan: PutPlan, tokens: np.ndarray) -> int:
        """Enter the written blocks into the index in chain order; returns the leading tokens now cached."""
        blocks, block_size = self._state.blocks, self.block_size
        if plan.reused_ids and not blocks.is_cached(plan.reused_ids[-1]):
            return 0  # the prefix was deleted while we wrote (cached chains are prefix closed: the last suffices)
        num_cached = min(plan.num_tokens, len(plan.reused_ids) * block_size)
        head = plan.head
        if head is None:
            return num_cached
        head_hash = plan.position_hash(head.position)
        segment = plan.position_tokens(tokens, head.position)
        if head.kind == EXTEND:
            if not blocks.is_cached(head.block_id):
                return num_cached  # deleted while we wrote
            blocks.extend_block(head.block_id, segment, head_hash)
        else:
            blocks.publish_chain([head.block_id], plan.position_parent(head.position), segment, [head_hash])
        if not plan.tail_ids:
            return plan.end
        # The head is full here and its hash is cached (ours, or a concurrent writer's): the tail hangs off it.
        assert head_hash is not None, "a block with blocks after it is full"
        first = head.position + 1
        tail_hashes: list[BlockHash | None] = list(plan.hashes[first : first + len(plan.tail_ids)])
        tail_hashes += [None] * (len(plan.tail_ids) - len(tail_hashes))  # a partial last block has no hash
        blocks.publish_chain(plan.tail_ids, head_hash, tokens[first * block_size : plan.end], tail_hashes)
        return plan.end

    def _release_plan(self, plan: PutPlan) -> None:
        if plan.head is not None and plan.head.kind == EXTEND:
            self._state.extending.discard(plan.head.block_id)
        self._state.blocks.release(plan.held_ids())

    # ---- removal ------------------------------------------------------------------------------------------------
    def delete(self, tokens, *, identity: KVCacheSpec | None = None) -> int:
        """Forget the cached prefix of `tokens` and everything stored under it, in every tier and durably (a warm
        restart does not bring it back); returns the blocks removed.

        The prefix starts at the sequence's first block (on the device: its first full block, or the partial tail
        it matches). Readers holding a removed block keep reading it; its memory is reused after they release it.

        Returns: the blocks removed (0: nothing cached).
        Raises: IdentityMismatch when `identity` is given and differs from the cache's; CachePurged once purged;
            ValueError for token ids outside [0, 2**31).
        """
        self._check_identity(identity)
        tokens = tokens_as_int32(tokens)
        chain = self._state.hasher.block_chain(tokens)
        with self._state.lock:
            self._state.check_not_purged()
            _, block_ids = self._match(tokens, chain, want_ids=True)
            removed_hashes: list = []
            num_removed = self._state.blocks.uncache(block_ids[:1], removed_hashes)
            num_removed += self._moves.forget_lower(chain, removed_hashes)
        self._moves.sync_lower()
        return num_removed

    def clear(self) -> int:
        """Forget every cached block in every tier, durably; returns how many were removed.

        Returns: the blocks removed.
        Raises: CachePurged once purged.
        """
        with self._state.lock:
            self._state.check_not_purged()
            removed_hashes: list = []
            num_removed = self._state.blocks.uncache(
                list(self._state.blocks.children(self._state.hasher.root)), removed_hashes
            )
            num_removed += self._moves.clear_lower(set(removed_hashes))
        self._moves.sync_lower()
        return num_removed

    # ---- accounting ---------------------------------------------------------------------------------------------
    def count_served(self, num_tokens: int) -> None:
        """Record that the KV of `num_tokens` tokens left in an answer (the data plane calls it once the answer is
        sent). Unlike num_hit_tokens it counts neither prefixes the client already had nor internal reads."""
        with self._state.lock:
            self._state.num_served_tokens += num_tokens

    def stats(self) -> CacheStats:
        with self._state.lock:
            blocks = self._state.blocks
            block_bytes = self.spec.block_bytes
            return CacheStats(
                num_blocks=blocks.num_blocks,
                num_used_blocks=blocks.num_used_blocks,
                num_free_blocks=blocks.num_free_blocks,
                num_cached_blocks=blocks.num_cached_blocks,
                num_hit_tokens=self._state.num_hit_tokens,
                num_miss_tokens=self._state.num_miss_tokens,
                num_evictions=blocks.num_evictions,
                num_cow_copies=self._state.num_cow_copies,
                num_stored_tokens=self._state.num_stored_tokens,
                block_bytes=block_bytes,
                bytes_resident=blocks.num_used_blocks * block_bytes,
                bytes_capacity=blocks.num_blocks * block_bytes,
                num_served_tokens=self._state.num_served_tokens,
            )

    def check_invariants(self) -> None:
        with self._state.lock:
            self._state.blocks.check_invariants(self._state.hasher.root)
            assert all(self._state.blocks.ref_cnt[b] > 0 for b in self._state.extending)
            assert self._state.active_io >= 0
        if self._state.tiers is not None and not self._state.purged:
            self._state.tiers.check_invariants()
