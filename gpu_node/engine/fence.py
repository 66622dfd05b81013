"""PurgeFence: how PagedKVCache.wipe (erasure's purge) guarantees that no reader is handed zeros as a hit and nothing
lands in the pool after it was wiped.

It works on the cache's CacheState (cache_state.py): `purged` (set once, never cleared: every operation then raises
CachePurged) and `active_io`, the sections that move bytes of the pool outside the lock — a put between plan and
publish, a `read`, and a handle whose `kv_views` were handed out (until the handle is released). wipe sets the
fence, uncaches everything, waits on `io_idle` until no section is open, and only then zeroes the pool; a section
can no longer begin once the fence is set, and a put that finishes writing after it is discarded at publish.
"""

from __future__ import annotations

from gpu_node.engine.cache_state import CacheState
from gpu_node.engine.tier_moves import TierMoves


class PurgeFence:
    """The cache's purge: fence, forget, wait for bytes in motion, zero (module docstring)."""

    def __init__(self, state: CacheState, moves: TierMoves):
        self._state = state
        self._moves = moves

    def wipe(self, *, wait_seconds: float = 60.0, keep_network: bool = False) -> int:
        """Purge (erasure): fence the cache, forget every block, wait for bytes in motion (puts writing, read
        sections), then overwrite the whole pool (and scales) with zeros and erase every lower tier (DRAM zeroed,
        the SSD directory deleted, the network store's objects removed unless `keep_network`: the cache lives on
        elsewhere, as after a migration or a detach that is not a deletion). Afterwards every operation raises
        CachePurged. A read section still open after `wait_seconds` (a peer that stopped reading) does not hold
        erasure up: the bytes are zeroed under it.

        Returns: the bytes that were resident; 0 on a second call (idempotent)."""
        state = self._state
        with state.lock:
            if state.purged:
                return 0
            state.purged = True
            state.removals += 1
            resident = state.blocks.num_used_blocks * state.spec.block_bytes
            state.blocks.uncache(list(state.blocks.children(state.hasher.root)))
            state.io_idle.wait_for(lambda: not state.active_io, timeout=wait_seconds)
            state.pool.zero_()
            if state.scales is not None:
                state.scales.zero_()
            state.pool_bytes = None
        return resident + self._moves.wipe_lower(keep_network=keep_network)
