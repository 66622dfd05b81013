"""TierMoves: how one cache moves blocks between its device pool and its lower tiers.

PagedKVCache is composed of it (and PurgeFence, BlockExchange), all sharing one CacheState (cache_state.py: the lock,
the block pool, the hasher, the tiers); this part keeps gpu_node/engine/paged_cache.py about the device pool. Lower
tiers (gpu_node/tiers/lower_tiers.py) are storage only: they never see the cache. Every tier operation takes the
request's BlockChain, computed once by the caller.

- demotion: the blocks an allocation evicted are copied out (under the cache lock, before the allocating writer
  overwrites them) and handed to the tiers with their lineage;
- lookup: the device's full blocks, then the lower tiers' run of the same chain (hashed only as far as it goes);
- promotion (get/acquire): the lower-tier run continuing the device prefix is fetched without the cache lock, then
  installed under it — unless the cache was purged or a delete/clear ran meanwhile (then only blocks not forgotten
  are kept, demoted back; the rest are zeroed and dropped: a deleted prefix never comes back);
- forgetting (delete, clear, wipe): device removals and the lower tiers' subtrees happen under the cache lock, so
  no promotion can interleave; the SSD makes them durable afterwards (`_sync_lower`, without the lock);
- the network tier: lookups and gets first probe the store (without the lock) for the chain's blocks after the
  device prefix that no lower tier knows; with write-through, a put's full blocks are copied out under the lock and
  the put returns once the store has them (or the store failed: counted, never an error of the put).

Every payload copy this module owns (fetched for promotion, copied out for demotion) is handed to a tier or zeroed.
"""

from __future__ import annotations

import numpy as np

from gpu_node.engine.block_events import LOWER_MEDIA, BlockEventLog
from gpu_node.engine.block_hash import BlockChain, BlockHash
from gpu_node.engine.cache_state import CacheState
from gpu_node.engine.checksum import block_checksum
from gpu_node.engine.zeroing import zero
from gpu_node.tiers.lower_tiers import LowerTiers, block_payloads, write_payloads


class _HeldBelow:
    """`block_hash in _HeldBelow(tiers)`: some lower tier holds the block (what BlockHasher.held_run probes)."""

    __slots__ = ("_has",)

    def __init__(self, tiers):
        self._has = tiers.has

    def __contains__(self, block_hash) -> bool:
        return self._has(block_hash)


class TierMoves:
    """The cache's moves between its device pool and its lower tiers (module docstring); `state` is the cache's."""

    def __init__(self, state: CacheState):
        self._state = state

    def attach(self, tiers: LowerTiers) -> None:
        """Demote evicted full blocks into `tiers` and promote them back on reads."""
        with self._state.lock:
            self._state.tiers = tiers

    def close(self) -> None:
        """Let go of the lower tiers' files without erasing them (the SSD store is closed: a later provisioning of
        the same cache rescans its directory: warm restart)."""
        if self._state.tiers is not None:
            self._state.lower().close()

    # ---- demotion (under the cache lock) --------------------------------------------------------------------------
    def demote_evicted(self, evicted: list | None) -> None:
        """Copy out and demote the full blocks an allocation evicted (BlockPool.allocate's `evicted`). Call under
        the cache lock, right after the allocation and before anything writes the blocks it handed out."""
        if not evicted:
            return
        block_ids = [block_id for block_id, _, _ in evicted]
        tokens = self._state.blocks.block_tokens
        lineages = [(parent, tokens[block_id].copy()) for block_id, _, parent in evicted]
        payloads = block_payloads(self._state.pool, self._state.scales, block_ids)
        for (_, block_hash, _), payload, lineage in zip(evicted, payloads, lineages):
            self._state.lower().demote(block_hash, payload, lineage)
        evicted.clear()

    def allocate_device(self, num_blocks: int) -> list[int]:
        """Under the cache lock: device blocks for a writer; what the allocation evicts is demoted (as a put does)."""
        evicted: list | None = [] if self._state.tiers is not None else None
        block_ids = self._state.blocks.allocate(num_blocks, evicted)
        self.demote_evicted(evicted)
        return block_ids

    def write_through_network(self, tokens: np.ndarray, hashes: list) -> None:
        """Without the cache lock, after a put: the put's full blocks the network tier lacks are copied out (under
        the lock) and stored; returns once the store has them, or its writes failed or timed out."""
        network, size, parent = self._state.lower().network, self._state.block_size, self._state.hasher.root
        with self._state.lock:
            if self._state.purged:
                return
            index = self._state.blocks.cached_hash_to_block
            wanted = []
            for i, block_hash in enumerate(hashes):
                if not network.contains(block_hash) and block_hash in index:
                    wanted.append((block_hash, index[block_hash], (parent, tokens[i * size : (i + 1) * size].copy())))
                parent = block_hash
            payloads = block_payloads(self._state.pool, self._state.scales, [block_id for _, block_id, _ in wanted])
            for (block_hash, _, lineage), payload in zip(wanted, payloads):
                self._state.lower().to_network(block_hash, payload, block_checksum(payload), lineage, owned=True)
        if wanted and not network.flush():
            network.num_write_through_timeouts += 1

    def adopt_network_blocks(self, entries: list[tuple[BlockHash, BlockHash, np.ndarray]]) -> int:
        """Without the cache lock: full blocks (parent, key, tokens) another node says the network store holds; those
        the store confirms join the network tier's index with their lineage. Returns how many the tier holds now."""
        if self._state.tiers is None or self._state.lower().network is None or not entries:
            return 0
        network = self._state.lower().network
        network.probe([key for _, key, _ in entries])
        held = 0
        with self._state.lock:
            self._state.check_not_purged()
            for parent, key, tokens in entries:
                if network.contains(key):
                    if key not in self._state.lower().lineage:
                        self._state.lower().lineage.add(key, parent, tokens)
                    held += 1
        return held

    def probe_network(self, tokens: np.ndarray, chain: BlockChain | None = None) -> None:
        """Without the cache lock: have the network tier learn which blocks of the chain after the device prefix the
        store holds (one batched question), so the lookup/promotion under the lock sees them."""
        if self._state.tiers is None or self._state.lower().network is None:
            return
        chain = chain if chain is not None else self._state.hasher.block_chain(tokens)
        with self._state.lock:
            num_full = self._state.num_cached_full_blocks(chain)
        self._state.lower().probe(chain.hashes(num_full))

    def announce_lower(self, log: BlockEventLog) -> None:
        """Have the cache's event log announce what the lower tiers gained and lost since it last did (under the
        cache lock, so it reads one state of every tier)."""
        if self._state.tiers is None:
            return
        with self._state.lock:
            held = self._state.lower().held_by_medium()
            log.announce_lower({LOWER_MEDIA[name]: blocks for name, blocks in held.items()})

    # ---- reads ----------------------------------------------------------------------------------------------------
    def lower_run_end(self, chain: BlockChain, num_full: int, tokens: np.ndarray) -> int:
        """Under the cache lock: tokens covered by the device's `num_full` blocks and the lower tiers' run after.

        `chain` (of `tokens`) may stop short of their last full block: lookup hashes only as far as the device holds
        the prompt. When the run reaches the chain's end, hashing goes on while some lower tier holds the block, one
        probe per block (lower tiers are not prefix closed: the run is the leading one, as count_run's)."""
        run = self._state.lower().count_run(chain.hashes(num_full))
        if num_full + run == len(chain) and len(chain) < len(tokens) // self._state.block_size:
            chain, more = self._state.hasher.held_run(tokens, _HeldBelow(self._state.tiers), after=chain)
            run += more
        return (num_full + run) * self._state.block_size

    def promote(self, tokens: np.ndarray, chain: BlockChain) -> int:
        """Bring the run of lower-tier blocks continuing the device prefix into the device pool; returns how many
        blocks were installed. Lower-tier I/O happens without the cache lock."""
        with self._state.lock:
            self._state.check_not_purged()
            num_full = self._state.num_cached_full_blocks(chain)
            wanted = chain.hashes(num_full)
            if not wanted or not self._state.lower().has(wanted[0]):
                return 0
            removals = self._state.removals
        payloads = self._state.lower().fetch_run(wanted)
        if not payloads:
            return 0
        with self._state.lock:
            hashes = wanted[: len(payloads)]
            if self._state.purged or self._state.removals != removals:
                return self._keep_unforgotten(chain, tokens, num_full, hashes, payloads)
            if self._state.num_cached_full_blocks(chain) != num_full:  # the device prefix changed meanwhile: keep them
                self._demote_back(chain, tokens, num_full, hashes, payloads)
                return 0
            return self._install(chain, tokens, num_full, hashes, payloads)

    def _install(self, chain: BlockChain, tokens: np.ndarray, num_full: int, hashes: list, payloads: list) -> int:
        """Under the cache lock: allocate device blocks after the (held) device prefix, write the payloads, publish."""
        blocks, block_size = self._state.blocks, self._state.block_size
        prefix_ids = [blocks.cached_hash_to_block[h] for h in chain.hashes(0, num_full)]
        blocks.hold(prefix_ids)  # so the allocation cannot evict the prefix the new blocks hang off
        block_ids = self.allocate_device(len(payloads))
        installed = len(block_ids)
        if installed:
            write_payloads(self._state.pool, self._state.scales, block_ids, payloads[:installed])
            segment = tokens[num_full * block_size : (num_full + installed) * block_size]
            blocks.publish_chain(block_ids, chain.parent(num_full), segment, hashes[:installed])
            for payload in payloads[:installed]:
                zero(payload)
        blocks.release(block_ids[::-1] + prefix_ids[::-1])
        self._demote_back(chain, tokens, num_full + installed, hashes[installed:], payloads[installed:])
        return installed

    def _demote_back(self, chain: BlockChain, tokens: np.ndarray, first: int, hashes: list, payloads: list) -> None:
        """Under the cache lock: demote blocks first, first+1, ... of `chain` again, with their lineage."""
        size = self._state.block_size
        for i, (block_hash, payload) in enumerate(zip(hashes, payloads), start=first):
            self._state.lower().demote(block_hash, payload, (chain.parent(i), tokens[i * size : (i + 1) * size]))

    def _keep_unforgotten(self, chain, tokens, num_full: int, hashes: list, payloads: list) -> int:
        """Under the cache lock, after a purge or a delete/clear raced a promotion: the fetched blocks that were
        forgotten meanwhile (no lineage left, or purged) are zeroed and dropped; the others go back to the tiers."""
        for i, (block_hash, payload) in enumerate(zip(hashes, payloads), start=num_full):
            if self._state.purged or block_hash not in self._state.lower().lineage:
                zero(payload)
            else:
                self._demote_back(chain, tokens, i, [block_hash], [payload])
        return 0

    # ---- forgetting -----------------------------------------------------------------------------------------------
    def forget_lower(self, chain: BlockChain, removed_on_device: list) -> int:
        """Under the cache lock, for delete: forget the sequence's chain (its own blocks too, so one lacking its
        lineage goes as well), the full blocks the device removed, and everything chained under them in the lower
        tiers; returns how many blocks that removed that the device had not already counted."""
        self._state.removals += 1
        if self._state.tiers is None:
            return 0
        on_device = set(removed_on_device)
        return sum(h not in on_device for h in self._state.lower().discard_subtrees(chain.hashes() + removed_on_device))

    def clear_lower(self, on_device: set) -> int:
        """Under the cache lock: forget every lower-tier block; returns how many were not also on the device."""
        self._state.removals += 1
        if self._state.tiers is None:
            return 0
        return len(self._state.lower().clear() - on_device)

    def sync_lower(self) -> None:
        """Without the cache lock: make the lower tiers' forgetting durable (SSD index commit)."""
        if self._state.tiers is not None:
            self._state.lower().sync()

    def wipe_lower(self, *, keep_network: bool = False) -> int:
        """Without the cache lock, after the device pool was fenced and zeroed: erase every lower tier (the network
        store's objects only unless `keep_network`)."""
        return self._state.lower().wipe(keep_network=keep_network) if self._state.tiers is not None else 0
