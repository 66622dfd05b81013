"""The indexer's reader of caches: every round, each ready cache of an active tenant has its block events read from
its node over the TLS data plane (an EVENTS request under a read-only data token the control plane issues itself:
audited and revoked with the tenant's, but the platform's (`platform_reader`), so not in the tenant's outstanding
quota: following a tenant's caches never takes tokens its engines need) and applied to the routing index
(routing.cache_index). One connection per followed cache, kept between rounds.

What a node's log says is what its cache's tiers held at the read (gpu_node/engine/block_events.py), so a lookup
answers per cache and per tier (GPU, CPU, STORAGE, NETWORK) with no question to the node on the request's path.
"""

from __future__ import annotations

import logging
import ssl
import time
import uuid
from dataclasses import dataclass

from caches.models import Cache, CacheState
from caches.services import data_token_issue
from core.errors import ApplicationError
from kcaas import wire
from kcaas.dataplane_transport import DataPlaneError, Transport
from kcaas.kv_events import EventFormatError, decode_batch
from kcaas.spec import KVCacheSpec
from routing import cache_index
from routing.models import CacheFollow
from tenants.models import Tenant

logger = logging.getLogger("kcaas.routing.caches")
MAX_BATCHES_PER_READ = 256
RENEW_FRACTION = 0.75  # a token is replaced once this much of its life is spent
MAX_BACKOFF_S = 60.0  # a cache whose node does not answer is retried at most this far apart


@dataclass
class _Reader:
    client: Transport  # the data plane's connection layer (kcaas.dataplane's client would bring torch along)
    endpoint: str
    epoch: int
    renew_at: float  # monotonic: issue a fresh token from here on
    next_seq: int | None = None  # the batch to read next; None: ask the follow (its row) first


class CacheFollower:
    def __init__(self, *, ssl_context: ssl.SSLContext | None = None, timeout_s: float = 5.0):
        self._ssl = ssl_context
        self._timeout = timeout_s
        self._readers: dict[uuid.UUID, _Reader] = {}
        self._failing: dict[uuid.UUID, tuple[int, float]] = {}  # cache -> (failures in a row, not before: monotonic)

    def step(self) -> int:
        """One round over every followed cache; returns the batches applied."""
        ready = {
            cache.id: cache
            for cache in Cache.objects.filter(state=CacheState.READY, tenant__status=Tenant.Status.ACTIVE).exclude(
                endpoint=""
            )
        }
        gone = set(CacheFollow.objects.exclude(cache_id__in=ready).values_list("cache_id", flat=True))
        for cache_id in (set(self._readers) - set(ready)) | gone:
            self._drop(cache_id)
            self._failing.pop(cache_id, None)
        if gone:
            cache_index.follow_stop(cache_ids=gone)
        return sum(self._read(cache) for cache in ready.values())

    def close(self) -> None:
        for cache_id in list(self._readers):
            self._drop(cache_id)

    def _read(self, cache: Cache) -> int:
        failures, not_before = self._failing.get(cache.id, (0, 0.0))
        if time.monotonic() < not_before:
            return 0
        try:
            reader = self._reader(cache)
            if reader is None:
                return 0
            if reader.next_seq is None:  # a new reader: the follow's row says where to go on (no query per round)
                follow = cache_index.follow_start(cache_id=cache.id, endpoint=cache.endpoint, epoch=cache.epoch)
                reader.next_seq = follow.next_seq
            since = reader.next_seq
            answer = reader.client.call_events(since, MAX_BATCHES_PER_READ)
            batches = [(seq, decode_batch(payload)) for seq, payload in answer.batches]
        except (DataPlaneError, OSError, EventFormatError) as exc:
            # backed off (1, 2, 4 ... 60 s); a refusal may be the token's: the next try gets a fresh one
            logger.info("caches: no events from cache %s at %s: %s", cache.id, cache.endpoint, exc)
            self._failing[cache.id] = (failures + 1, time.monotonic() + min(MAX_BACKOFF_S, 2.0**failures))
            if isinstance(exc, DataPlaneError):
                self._drop(cache.id)
            elif cache.id in self._readers:
                self._readers[cache.id].client.close()  # reconnects on the next try, with the same token
            return 0
        self._failing.pop(cache.id, None)
        if answer.next_seq < since:  # the node's log started over (its agent restarted)
            cache_index.follow_restart(cache_id=cache.id)
            reader.next_seq = 0
            return 0
        if since < answer.first_seq:
            logger.warning("caches: cache %s's log dropped batches before they were read", cache.id)
            cache_index.follow_restart(cache_id=cache.id, next_seq=answer.first_seq, gap=True)
            reader.next_seq = answer.first_seq
        applied = 0
        for seq, batch in batches:
            if not cache_index.apply_cache_batch(cache_id=cache.id, seq=seq, batch=batch):
                reader.next_seq = None  # the row moved on or is gone (erasure): read it again next round
                break
            reader.next_seq = seq + 1
            applied += 1
        return applied

    def _reader(self, cache: Cache) -> _Reader | None:
        """The cache's open reader, a new one (a fresh token) when none, when the cache moved, or its token is old."""
        reader = self._readers.get(cache.id)
        if reader is not None and (reader.endpoint, reader.epoch) == (cache.endpoint, cache.epoch):
            if time.monotonic() < reader.renew_at:
                return reader
        self._drop(cache.id)
        try:
            issued = data_token_issue(tenant_id=cache.tenant_id, cache_id=cache.id, access="read", platform_reader=True)
        except ApplicationError as exc:  # quota spent, tenant inactive, cache no longer ready: next round
            logger.info("caches: no data token for cache %s: %s", cache.id, exc)
            return None
        lifetime = issued.claims["exp"] - issued.claims["iat"]
        client = Transport(
            cache.endpoint,
            None,
            issued.token,
            str(cache.id),
            KVCacheSpec(**cache.spec_dict()),
            ssl_context=self._ssl_context(),
            server_hostname=None,
            timeout=self._timeout,
            max_frame_bytes=wire.DEFAULT_MAX_FRAME_BYTES,
            max_overloaded_retries=2,
        )
        reader = _Reader(client, cache.endpoint, cache.epoch, time.monotonic() + RENEW_FRACTION * lifetime)
        self._readers[cache.id] = reader
        return reader

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            from fleet.well_known import ca_bundle_pem  # the CAs the SDK trusts for nodes' data planes

            self._ssl = ssl.create_default_context(cadata=ca_bundle_pem())
            self._ssl.minimum_version = ssl.TLSVersion.TLSv1_3
        return self._ssl

    def _drop(self, cache_id: uuid.UUID) -> None:
        reader = self._readers.pop(cache_id, None)
        if reader is not None:
            reader.client.close()
