"""The engine facade's purge fence: how PagedKVCache.wipe (erasure's purge) guarantees that no reader is handed
zeros as a hit and nothing lands in the pool after it was wiped.

State (on the cache, under its lock): `_purged` (set once, never cleared: every operation then raises CachePurged)
and `_active_io`, the sections that move bytes of the pool outside the lock — a put between plan and publish, a
`read`, and a handle whose `kv_views` were handed out (until the handle is released). wipe sets the fence, uncaches
everything, waits on `_io_idle` until no section is open, and only then zeroes the pool; a section can no longer
begin once the fence is set, and a put that finishes writing after it is discarded at publish.
"""

from __future__ import annotations

from gpu_node.engine_tiers import CachePurged


class PurgeFence:
    """Mixin of PagedKVCache: the purge fence and wipe."""

    # The state it keeps on the cache (set in PagedKVCache.__init__), declared for the type checker.
    _purged: bool
    _active_io: int
    _pool_bytes: memoryview | None

    def _check_not_purged(self) -> None:
        if self._purged:
            raise CachePurged("this cache was purged: its KV is gone")

    def _begin_io(self) -> None:
        """Enter a section that moves bytes of the pool (a purge waits for it); refused once purged."""
        with self._lock:
            self._check_not_purged()
            self._active_io += 1

    def _end_io(self) -> None:
        with self._lock:
            self._end_io_locked()

    def _end_io_locked(self) -> None:
        assert self._active_io > 0, "ended a section nobody began"
        self._active_io -= 1
        if not self._active_io:
            self._io_idle.notify_all()

    def _begin_read(self, handle) -> None:
        if not handle.reading:
            self._begin_io()
            handle.reading = True

    def wipe(self, *, wait_seconds: float = 60.0, keep_network: bool = False) -> int:
        """Purge (erasure): fence the cache, forget every block, wait for bytes in motion (puts writing, read
        sections), then overwrite the whole pool (and scales) with zeros and erase every lower tier (DRAM zeroed,
        the SSD directory deleted, the network store's objects removed unless `keep_network`: the cache lives on
        elsewhere, as after a migration or a detach that is not a deletion). Afterwards every operation raises
        CachePurged. Returns the bytes that were resident. Idempotent (a second call returns 0). A read section
        still open after `wait_seconds` (a peer that stopped reading) does not hold erasure up: the bytes are zeroed
        under it."""
        with self._lock:
            if self._purged:
                return 0
            self._purged = True
            self._removals += 1
            resident = self._blocks.num_used_blocks * self.spec.block_bytes
            self._blocks.uncache(list(self._blocks.children(self._hasher.root)))
            self._io_idle.wait_for(lambda: not self._active_io, timeout=wait_seconds)
            self.pool.zero_()
            if self.scales is not None:
                self.scales.zero_()
            self._pool_bytes = None
        return resident + self._wipe_lower(keep_network=keep_network)
