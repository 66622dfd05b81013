"""Writes of the routing index for a tenant's caches: the indexer follows each ready cache's block events on its node
(routing.cache_follower) and applies them here, strictly in seq order, each batch once.

A follow names the node log it reads (the cache's data-plane endpoint and epoch): when either changes (the cache
moved, or was provisioned again), or the log went back (its agent restarted), what the index held of the cache is
dropped and the follow starts over from seq 0. Batches the log dropped before they were read leave the index
unknowable: it is dropped too, and the gap counted (docs/routing.md: a cache's blocks are never advertised from a
view that may be stale).
"""

from __future__ import annotations

import uuid

from django.db import transaction
from django.db.models import F

from caches.models import Cache
from kcaas.kv_events import EventBatch
from routing.models import CacheFollow, IndexedBlock
from routing.services import apply_batch_to


def follow_start(*, cache_id: uuid.UUID, endpoint: str, epoch: int) -> CacheFollow:
    """The cache's follow of the log at (endpoint, epoch): the one kept when it names that log, else a new one from
    seq 0, the cache's index dropped."""
    with transaction.atomic():
        follow = CacheFollow.objects.select_for_update().filter(cache_id=cache_id).first()
        if follow is not None and (follow.endpoint, follow.epoch) == (endpoint, epoch):
            return follow
        IndexedBlock.objects.filter(cache_id=cache_id).delete()
        follow, _ = CacheFollow.objects.update_or_create(
            cache_id=cache_id,
            defaults={"endpoint": endpoint, "epoch": epoch, "next_seq": 0, "events_applied": 0, "last_event_at": None},
        )
        return follow


def follow_restart(*, cache_id: uuid.UUID, next_seq: int = 0, gap: bool = False) -> None:
    """The index of the cache is dropped and its follow goes on from `next_seq` (the log restarted: 0; it dropped
    batches never read: its oldest kept one, and the gap is counted)."""
    with transaction.atomic():
        IndexedBlock.objects.filter(cache_id=cache_id).delete()
        CacheFollow.objects.filter(cache_id=cache_id).update(next_seq=next_seq, gaps=F("gaps") + (1 if gap else 0))


def follow_stop(*, cache_ids) -> int:
    """Caches no longer followed (not ready, detached, their tenant suspended): their follows and index gone."""
    with transaction.atomic():
        IndexedBlock.objects.filter(cache_id__in=cache_ids).delete()
        count, _ = CacheFollow.objects.filter(cache_id__in=cache_ids).delete()
    return count


def apply_cache_batch(*, cache_id: uuid.UUID, seq: int, batch: EventBatch) -> bool:
    """Apply one batch of the cache's log if it is the one expected next; False (nothing applied) otherwise."""
    with transaction.atomic():
        follow = CacheFollow.objects.select_for_update().filter(cache_id=cache_id).first()
        if follow is None or seq != follow.next_seq:
            return False
        cache = Cache.objects.only("id", "block_size").get(id=cache_id)
        apply_batch_to({"cache": cache}, cache.block_size, follow, seq, batch)
    return True
