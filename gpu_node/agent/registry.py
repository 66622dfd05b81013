"""The caches one node agent hosts: cache id -> (epoch, identity, capacity, the PagedKVCache holding its blocks).

Invariants (under the registry lock):
- the device bytes promised to hosted caches plus those reserved by provisionings in flight never exceed the node's
  device capacity;
- a cache id is hosted at most once, at one epoch; provisioning is idempotent per (id, epoch): a duplicate or stale
  delivery (same or older epoch) returns what is hosted, a newer epoch replaces it (the control plane moved the
  cache away and back);
- detaching with an older epoch than the hosted one is ignored (a stale message must not drop a newer incarnation).
The pool of a new cache is allocated (and pre-faulted) outside the lock, so provisioning one cache never stalls
requests to the others.

Lower tiers (gpu_node/tiers/lower_tiers.py): a capacity with `dram` bytes gets a DRAM tier; one with `ssd` bytes and a
data key (`ssd_key`, from provision_cache) gets an SSD store under `<ssd_dir>/<cache id>/`, which is rescanned when it
exists (warm restart: same id, epoch and keys after an agent restart). Only one store is open per directory: a newer
epoch closes the old one first. Detach deletes the cache's directory, hosted or not (gpu_node/tiers/cache_dirs.py: not
when a newer epoch wrote it, nor while a provisioning of it is in flight); purge_tenant zeroes DRAM and deletes the
tenant's directories, hosted or left over from an earlier run; remove_unplaced_directories (at registration)
deletes those of every cache the control plane no longer places here, never one hosted or being provisioned.
A capacity with `network` bytes and a data key gets a network tier when the node has a network store (`network_store`,
a gpu_node.tiers.guarded_store.GuardedStore shared by every cache of this process); `network_write_through` (per cache)
makes puts wait until their full blocks are in it. Detach closes it and leaves its objects (the cache may come
back elsewhere); purge_tenant removes them.

Purge listeners (the data plane) run inside purge_tenant after the tenant's caches stop being hosted and before
their pools are wiped: they close the tenant's connections and zero their buffers.

Usage counters (`usage_snapshot`, billing): per cache id, bytes written and tokens served since this process
started, monotonic: an engine that goes away (detach, purge, a newer epoch) leaves its counts to the cache id, and
a cache that stopped being hosted is reported once more with 0 resident bytes, closing its resident interval.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from gpu_node.engine.paged_cache import PagedKVCache
from gpu_node.errors import NodeError
from gpu_node.tiers import cache_dirs
from gpu_node.tiers import lower_tiers as tiers
from kcaas.spec import KVCacheSpec

TIERS = ("device", "dram", "ssd", "network")
log = logging.getLogger(__name__)


class ProvisionError(NodeError):
    """A provisioning the node refuses; `reason` is the failure reason it reports to the control plane."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class HostedCache:
    cache_id: str
    epoch: int
    spec: KVCacheSpec
    capacity: dict[str, int]
    engine: PagedKVCache
    tenant_id: str = ""  # whose cache it is ("" from a control plane that did not say): purge_tenant's key


class CacheRegistry:
    def __init__(
        self,
        *,
        device_capacity_bytes: int,
        device: torch.device | str | None = None,
        ssd_dir: str | None = None,
        network_store=None,
    ):
        self.device_capacity_bytes = device_capacity_bytes
        self.network_store = network_store  # a GuardedStore, or None: caches get no network tier
        self.device = device
        self.ssd_dir = ssd_dir or cache_dirs.default_ssd_root()
        self._lock = threading.Lock()
        self._caches: dict[str, HostedCache] = {}
        self._reserved_in_flight = 0
        # cache id -> (bytes written, tokens served) by its engines that are gone
        self._retired_counts: dict[str, tuple[int, int]] = {}
        self._unreported_gone: set[str] = set()  # no longer hosted, not yet reported with 0 resident bytes
        self._purge_listeners: list = []  # callables(tenant_id) told of a purge before its pools are wiped
        self._provisioning: dict[str, int] = {}  # cache id -> provisionings in flight (their directory is in use)

    def provision(
        self,
        *,
        cache_id: str,
        spec: KVCacheSpec,
        capacity: dict[str, int],
        hash_key: bytes,
        epoch: int,
        tenant_id: str = "",
        ssd_key: bytes | None = None,
        network_write_through: bool = False,
    ) -> HostedCache:
        device_bytes = int(capacity.get("device", 0))
        if device_bytes < spec.block_bytes:
            raise ProvisionError(
                "invalid_capacity", f"device capacity {device_bytes} holds no {spec.block_bytes}-byte block"
            )
        with self._lock:
            hosted = self._caches.get(cache_id)
            if hosted is not None and hosted.epoch >= epoch:
                return hosted
            replaced_bytes = hosted.capacity["device"] if hosted is not None else 0
            if self._used_locked() - replaced_bytes + device_bytes > self.device_capacity_bytes:
                raise ProvisionError("insufficient_capacity", "not enough device memory on this node")
            self._reserved_in_flight += device_bytes
            self._provisioning[cache_id] = self._provisioning.get(cache_id, 0) + 1
        if hosted is not None:
            hosted.engine.close()  # one open store per directory: the newer epoch rescans it
        try:
            engine = PagedKVCache(spec, hash_key=hash_key, capacity_bytes=device_bytes, device=self.device)
            lower = tiers.open_tiers(
                self.ssd_dir,
                cache_id,
                str(tenant_id or ""),
                capacity,
                spec.block_bytes,
                ssd_key,
                network_store=self.network_store,
                network_write_through=network_write_through,
            )
            if lower is not None:
                engine.attach_tiers(lower)
            cache_dirs.record_epoch(self.ssd_dir, cache_id, epoch)
        except BaseException:
            with self._lock:
                self._end_provisioning_locked(cache_id, device_bytes)
            raise
        hosted = HostedCache(
            cache_id, epoch, spec, {t: int(capacity.get(t, 0)) for t in TIERS}, engine, str(tenant_id or "")
        )
        with self._lock:
            self._end_provisioning_locked(cache_id, device_bytes)
            current = self._caches.get(cache_id)
            if current is not None and current.epoch >= epoch:
                engine.close()
                return current  # a concurrent delivery of the same provisioning won
            if current is not None:
                self._retire_locked(current)
            self._caches[cache_id] = hosted
            self._unreported_gone.discard(cache_id)
        return hosted

    def _end_provisioning_locked(self, cache_id: str, device_bytes: int) -> None:
        self._reserved_in_flight -= device_bytes
        left = self._provisioning.pop(cache_id) - 1
        if left:
            self._provisioning[cache_id] = left

    def detach(self, *, cache_id: str, epoch: int, forget_network: bool = False) -> bool:
        """Stop hosting a cache and purge its engine (a reader sending its blocks finishes first; holders that have
        not started reading get CachePurged); False if not hosted.

        Its SSD directory goes either way: wiped with the hosted cache, or, for a cache not hosted (it failed with
        its node lost, the agent restarted since), deleted from disk, unless a newer epoch than `epoch` wrote it or
        a provisioning of it is in flight."""
        with self._lock:
            hosted = self._caches.get(cache_id)
            if hosted is None:
                in_use = cache_id in self._provisioning
                taken = None if in_use else cache_dirs.take(self.ssd_dir, cache_id, epoch=epoch)
            elif hosted.epoch <= epoch:
                del self._caches[cache_id]
                self._retire_locked(hosted, gone=True)
        if hosted is None:
            cache_dirs.delete(taken)  # renamed away under the lock: a later provisioning starts a fresh one
            return False
        if hosted.epoch > epoch:
            return False
        # its blocks are no longer this node's to keep: pool zeroed, DRAM zeroed, SSD deleted; its network objects
        # only when the cache itself is deleted (`forget_network`): a migrated cache reads them on its new node
        hosted.engine.wipe(keep_network=not forget_network)
        return True

    def remove_unplaced_directories(self, stored: list[str]) -> list[str]:
        """Delete the SSD directories of the caches that are none of: `stored` (what the control plane places on
        this node or migrates to it, from its register answer), hosted here, being provisioned here. A warm restart
        keeps its directories: the control plane places those caches here still and provisions them again (same
        id and epoch: the store rescans the directory). A directory a live store of another process holds is never
        deleted (cache_dirs.take skips it). Returns the cache ids whose directory was deleted."""
        keep = {str(cache_id) for cache_id in stored}
        with self._lock:
            keep |= set(self._caches) | set(self._provisioning)
            gone = [name for name in cache_dirs.names(self.ssd_dir) if name not in keep]
            taken = {name: cache_dirs.take(self.ssd_dir, name) for name in gone}
        for path in taken.values():
            cache_dirs.delete(path)
        cache_dirs.delete_leftovers(self.ssd_dir)
        return [name for name, path in taken.items() if path is not None]

    def purge_tenant(self, tenant_id: str) -> list[dict]:
        """Stop hosting every cache of the tenant, whatever its epoch, and wipe its pool (zeros): erasure.
        Returns [{"cache_id", "freed_bytes"}] (the bytes that were resident). Idempotent: a second call frees 0.

        Order: the caches stop being hosted (no new request reaches them), then the purge listeners run (the data
        plane closes the tenant's connections and zeroes their buffers, so no request is still writing), then the
        pools are wiped and the tenant's SSD directories deleted."""
        if not tenant_id:
            return []
        with self._lock:
            purged = [h for h in self._caches.values() if h.tenant_id == str(tenant_id)]
            for hosted in purged:
                del self._caches[hosted.cache_id]
                self._retire_locked(hosted, gone=True)
            listeners = list(self._purge_listeners)
        for listener in listeners:
            try:
                listener(str(tenant_id))
            except Exception:
                log.exception("a purge listener failed")
        freed = [
            {"cache_id": h.cache_id, "freed_bytes": h.engine.wipe()} for h in sorted(purged, key=lambda h: h.cache_id)
        ]
        cache_dirs.purge_tenant_directories(self.ssd_dir, str(tenant_id))  # leftovers of caches not hosted now
        return freed

    def add_purge_listener(self, listener) -> None:
        """`listener(tenant_id)` is called by every purge_tenant, after the tenant's caches stop being hosted and
        before their pools are wiped (the data plane: close the tenant's connections, zero their buffers)."""
        with self._lock:
            if listener not in self._purge_listeners:
                self._purge_listeners.append(listener)

    def remove_purge_listener(self, listener) -> None:
        with self._lock:
            if listener in self._purge_listeners:
                self._purge_listeners.remove(listener)

    def get(self, cache_id: str) -> HostedCache | None:
        with self._lock:
            return self._caches.get(cache_id)

    def cache_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._caches)

    def _used_locked(self) -> int:
        return sum(h.capacity["device"] for h in self._caches.values()) + self._reserved_in_flight

    def used_device_bytes(self) -> int:
        with self._lock:
            return self._used_locked()

    def _retire_locked(self, hosted: HostedCache, *, gone: bool = False) -> None:
        written, served = self._retired_counts.get(hosted.cache_id, (0, 0))
        engine_written, engine_served = _engine_counts(hosted)
        self._retired_counts[hosted.cache_id] = (written + engine_written, served + engine_served)
        if gone:
            self._unreported_gone.add(hosted.cache_id)

    def usage_snapshot(self) -> list[dict]:
        """Per cache: resident bytes per tier now and counters since this process started (bytes_written_total:
        KV bytes written into the pool by puts; tokens_served_total: tokens of KV sent in GET answers), for the
        usage report. Caches no longer hosted appear once more, with 0 resident bytes."""
        with self._lock:
            hosted = list(self._caches.values())
            retired = dict(self._retired_counts)
            gone, self._unreported_gone = self._unreported_gone, set()
        entries = []
        for h in hosted:
            written, served = _engine_counts(h)
            base_written, base_served = retired.get(h.cache_id, (0, 0))
            entries.append(_usage_entry(h.cache_id, _resident_by_tier(h), base_written + written, base_served + served))
        entries += [_usage_entry(cache_id, {}, *retired[cache_id]) for cache_id in sorted(gone)]
        return entries

    def resident_snapshot(self) -> list[dict]:
        """Absolute resident bytes per cache and tier, in the heartbeat's shape (billing integrates these), with the
        engine's hit and miss token counters since the cache was provisioned here (the control plane's hit rate)."""
        with self._lock:
            hosted = list(self._caches.values())
        return [_resident_entry(h) for h in hosted]


def _resident_entry(hosted: HostedCache) -> dict:
    stats = hosted.engine.stats()
    return {
        "cache_id": hosted.cache_id,
        **_resident_fields(_resident_by_tier(hosted)),
        "hit_tokens": stats.num_hit_tokens,
        "miss_tokens": stats.num_miss_tokens,
    }


def _engine_counts(hosted: HostedCache) -> tuple[int, int]:
    """(bytes written, tokens served) by one engine: stored tokens at the pool's bytes per token."""
    stats = hosted.engine.stats()
    return stats.num_stored_tokens * hosted.spec.storage_bytes_per_token, stats.num_served_tokens


def _resident_by_tier(hosted: HostedCache) -> dict[str, int]:
    """Resident bytes of one cache per tier: used device blocks, DRAM payloads, live SSD blocks."""
    lower = hosted.engine.tiers.resident_bytes() if hosted.engine.tiers is not None else {}
    return {"device": hosted.engine.stats().bytes_resident, **lower}


def _resident_fields(resident: dict[str, int]) -> dict[str, int]:
    return {f"{tier}_bytes": int(resident.get(tier, 0)) for tier in TIERS}


def _usage_entry(cache_id: str, resident: dict[str, int], written: int, served: int) -> dict:
    return {
        "cache_id": cache_id,
        **_resident_fields(resident),
        "bytes_written_total": written,
        "tokens_served_total": served,
    }
