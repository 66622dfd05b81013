"""Recovery of a cache whose node was lost, from the fleet's network tier (POST /v1/caches/{id}/recover).

A cache on a lost node is `failed` with `node_lost` (caches.services.caches_sweep_leases). Its device, DRAM and SSD
bytes went with the node, but the objects it stored in the network store did not (docs/ARCHITECTURE.md, the network
tier). Recovery re-places it on another node through the attach path (fleet.services.node_place on its node tiers,
the outbox's provisioning order, the node's answer making it ready) at a new epoch, with the same keys, so the new
node names and opens the very objects the lost one stored and finds them on lookup.

It runs on request, never by itself: the tenant decides whether re-creating the cache elsewhere is worth the node
bytes it reserves again (and pays for), or whether to detach it and let engines recompute.

Invariants: only a `failed` cache with failure_reason `node_lost` and network bytes is recovered (409 otherwise:
cache_not_node_lost, cache_without_network_tier; network_tier_absent when the fleet's store is gone); the cache keeps
its share of the store (held while not detached) and its quota (a failed cache counts already), so neither is
charged again; the epoch grows by one, fencing anything the lost node might still say about it; the audit event
`cache_recovered` is written in the same transaction. Lock order: tenant -> cache -> nodes (caches.services').
"""

from __future__ import annotations

import uuid

from django.db import transaction

from audit.actions import AuditAction
from caches.errors import CacheNotRecoverable
from caches.models import Cache, CacheState
from caches.network_store import network_tier_require
from caches.services import NODE_LOST, _audit, _lock_cache, _provision
from core.errors import ConflictError, NotFoundError
from core.ids import as_uuid
from fleet.services import node_place
from tenants.models import Tenant
from tenants.services import tenant_lock

CACHE_NOT_NODE_LOST = "cache_not_node_lost"
CACHE_WITHOUT_NETWORK_TIER = "cache_without_network_tier"


def _recoverable(cache: Cache) -> None:
    """409 unless `cache` lost its node and has a network tier to come back from."""
    if cache.state != CacheState.FAILED or cache.failure_reason != NODE_LOST:
        raise CacheNotRecoverable(
            "Only a cache whose node was lost (failed, node_lost) can be recovered.",
            code=CACHE_NOT_NODE_LOST,
            details={"state": cache.state, "failure_reason": cache.failure_reason},
        )
    if cache.network_capacity_bytes <= 0:
        raise CacheNotRecoverable(
            "The cache has no network tier: nothing of it outlived its node. Detach it and attach it again.",
            code=CACHE_WITHOUT_NETWORK_TIER,
            details={"state": cache.state, "capacity": cache.capacity()},
        )


@transaction.atomic
def cache_recover(*, cache_id, tenant_id: uuid.UUID | None) -> Cache:
    """Re-place a node_lost cache with a network tier on another node: pending -> provisioning at epoch + 1 (the
    node's answer makes it ready, as after an attach). 404 for another tenant's (or no) cache (tenant_id None:
    staff, any tenant); 409 cache_not_node_lost / cache_without_network_tier / network_tier_absent /
    tenant_inactive; 503 no_capacity when no node has its node tiers free."""
    wanted = as_uuid(cache_id)
    owner = Cache.objects.filter(pk=wanted).values_list("tenant_id", flat=True).first() if wanted else None
    if owner is None or (tenant_id is not None and owner != tenant_id):
        raise NotFoundError("No such cache.")
    tenant = tenant_lock(tenant_id=owner)
    cache = _lock_cache(wanted, tenant_id=owner)
    if cache is None:
        raise NotFoundError("No such cache.")
    _recoverable(cache)
    if tenant.status != Tenant.Status.ACTIVE:
        raise ConflictError(f"The tenant is {tenant.status}.", code="tenant_inactive")
    network_tier_require()
    node = node_place(capacity=cache.node_capacity())
    old = {"state": cache.state, "failure_reason": cache.failure_reason, "node_id": cache.node_id, "epoch": cache.epoch}
    cache.node, cache.epoch = node, cache.epoch + 1
    cache.state, cache.failure_reason, cache.endpoint = CacheState.PENDING, "", ""
    cache.save(update_fields=["node", "epoch", "state", "failure_reason", "endpoint", "updated_at"])
    _provision(cache)
    new = {"state": cache.state, "failure_reason": "", "node_id": cache.node_id, "epoch": cache.epoch}
    _audit(AuditAction.CACHE_RECOVERED, cache, old=old, new=new)
    return cache
