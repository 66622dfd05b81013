"""Reads of the caches app. Tenant scoping happens here: given a tenant, a selector never returns another's rows."""

import uuid
from dataclasses import dataclass

from django.db.models import Count, Q, QuerySet, Sum
from django.utils import timezone

from caches.models import TIERS, Cache, CacheState, DataToken
from controlplane.errors import NotFoundError
from tenants.ids import as_uuid


@dataclass(frozen=True, slots=True)
class CacheUsage:
    """What a tenant's non-detached caches hold against its quota."""

    num_caches: int
    capacity_bytes: dict[str, int]


def cache_list(*, tenant_id: uuid.UUID | None, state: str | None = None) -> QuerySet[Cache]:
    """The tenant's caches, newest first (tenant_id None: every tenant's, for staff)."""
    caches = Cache.objects.order_by("-created_at", "id")
    if tenant_id is not None:
        caches = caches.filter(tenant_id=tenant_id)
    if state is not None:
        caches = caches.filter(state=state)
    return caches


def cache_get(*, cache_id, tenant_id: uuid.UUID | None) -> Cache:
    """The cache, within the tenant (None: any, for staff); another tenant's cache is a 404 like a missing one."""
    wanted = as_uuid(cache_id)
    cache = cache_list(tenant_id=tenant_id).filter(pk=wanted).first() if wanted else None
    if cache is None:
        raise NotFoundError("No such cache.")
    return cache


def cache_usage(*, tenant_id: uuid.UUID) -> CacheUsage:
    """Count and bytes per tier of the tenant's non-detached caches (one query)."""
    totals = Cache.objects.filter(tenant_id=tenant_id).exclude(state=CacheState.DETACHED).aggregate(
        num_caches=Count("id"), **{tier: Sum(f"{tier}_capacity_bytes") for tier in TIERS}
    )
    return CacheUsage(
        num_caches=totals["num_caches"], capacity_bytes={tier: int(totals[tier] or 0) for tier in TIERS}
    )


def data_tokens_outstanding(*, tenant_id: uuid.UUID, now=None) -> int:
    """Tokens of the tenant neither expired nor revoked."""
    now = now or timezone.now()
    return DataToken.objects.filter(tenant_id=tenant_id, revoked_at__isnull=True, expires_at__gt=now).count()


def caches_on_node(*, node_id: uuid.UUID) -> list[dict]:
    """What the control plane believes a node hosts (for its register response): id, epoch, state, capacity."""
    caches = Cache.objects.filter(node_id=node_id).filter(
        Q(state__in=[CacheState.PENDING, CacheState.PROVISIONING, CacheState.READY, CacheState.DETACHING])
    )
    return [
        {"cache_id": str(c.id), "epoch": c.epoch, "state": c.state, "capacity": c.capacity()}
        for c in caches.order_by("id")
    ]
