"""Reads of the caches app. Tenant scoping happens here: given a tenant, a selector never returns another's rows."""

import uuid
from dataclasses import dataclass
from datetime import datetime

from django.db.models import Case, Count, Q, QuerySet, Sum, When
from django.utils import timezone

from caches.models import ACTIVE_MIGRATION_STATES, RESERVING_STATES, TIERS, Cache, CacheState, DataToken, Migration
from core.errors import NotFoundError
from core.ids import as_uuid
from fleet.models import Node
from tenants.models import Tenant
from tenants.selectors import QuotaLimits, quota_limits


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


def cache_resident_bytes_reported(cache: Cache, snapshot: dict | None = None) -> int:
    """Bytes (all tiers) the cache's node last reported holding for it: 0 with no node, no report, or only a report
    from before the cache was last emptied (that node came back without its blocks since). `snapshot`: the node's
    resident snapshot when the caller has it (caches_contents reads each node's once for a page); else one query."""
    if cache.node_id is None:
        return 0
    if snapshot is None:
        snapshot = Node.objects.filter(pk=cache.node_id).values_list("resident_snapshot", flat=True).first() or {}
    reported_at = snapshot.get("reported_at")
    if cache.emptied_at is not None and (reported_at is None or datetime.fromisoformat(reported_at) < cache.emptied_at):
        return 0
    entry = (snapshot.get("caches") or {}).get(str(cache.pk)) or {}
    return sum(int(entry.get(tier, 0)) for tier in TIERS)


def caches_contents(caches) -> dict[uuid.UUID, str]:
    """ "warm" or "cold" for each of `caches` (cache_resident_bytes_reported > 0), reading each node's resident
    snapshot once (one query for the lot), not once per cache."""
    node_ids = {cache.node_id for cache in caches if cache.node_id is not None}
    snapshots = dict(Node.objects.filter(pk__in=node_ids).values_list("pk", "resident_snapshot")) if node_ids else {}
    return {
        cache.pk: "warm" if cache_resident_bytes_reported(cache, snapshots.get(cache.node_id) or {}) > 0 else "cold"
        for cache in caches
    }


def cache_usage(*, tenant_id: uuid.UUID) -> CacheUsage:
    """Count and bytes per tier of the tenant's non-detached caches (one query)."""
    return cache_usage_by_tenant(tenant_ids=[tenant_id])[tenant_id]


def cache_usage_by_tenant(*, tenant_ids) -> dict[uuid.UUID, CacheUsage]:
    """Count and bytes per tier of each given tenant's non-detached caches, in one query; a tenant without live
    caches gets zeros."""
    tenant_ids = list(tenant_ids)
    rows = (
        Cache.objects.filter(tenant_id__in=tenant_ids)
        .exclude(state=CacheState.DETACHED)
        .values("tenant_id")
        .annotate(num_caches=Count("id"), **{tier: Sum(f"{tier}_capacity_bytes") for tier in TIERS})
        .order_by()
    )
    found = {
        row["tenant_id"]: CacheUsage(
            num_caches=row["num_caches"], capacity_bytes={tier: int(row[tier] or 0) for tier in TIERS}
        )
        for row in rows
    }
    empty = CacheUsage(num_caches=0, capacity_bytes=dict.fromkeys(TIERS, 0))
    return {tenant_id: found.get(tenant_id, empty) for tenant_id in tenant_ids}


def cache_resident_bytes(*, tenant_id: uuid.UUID) -> dict[str, int]:
    """Bytes per tier the nodes last reported resident (heartbeat snapshots) for the tenant's non-detached caches
    on their current node (two queries). A cache its node has not reported counts 0; never more than reported."""
    placed = (
        Cache.objects.filter(tenant_id=tenant_id, node_id__isnull=False)
        .exclude(state=CacheState.DETACHED)
        .values_list("id", "node_id")
    )
    caches_by_node: dict[uuid.UUID, list[str]] = {}
    for cache_id, node_id in placed:
        caches_by_node.setdefault(node_id, []).append(str(cache_id))
    totals = dict.fromkeys(TIERS, 0)
    snapshots = Node.objects.filter(pk__in=list(caches_by_node)).values_list("id", "resident_snapshot")
    for node_id, snapshot in snapshots:
        reported = (snapshot or {}).get("caches") or {}
        for cache_id in caches_by_node[node_id]:
            for tier in TIERS:
                totals[tier] += int((reported.get(cache_id) or {}).get(tier, 0))
    return totals


@dataclass(frozen=True, slots=True)
class TenantUsage:
    """A tenant's effective quota limits next to what it consumes (GET /usage)."""

    limits: QuotaLimits
    caches: CacheUsage
    data_tokens_outstanding: int
    resident_bytes: dict[str, int]


def tenant_usage(*, tenant: Tenant) -> TenantUsage:
    """The limits and the same counts the quota checks of caches.services compare them with (not locked: a
    snapshot, possibly stale by the time it is read), plus the resident bytes the nodes last reported."""
    return TenantUsage(
        limits=quota_limits(tenant=tenant),
        caches=cache_usage(tenant_id=tenant.pk),
        data_tokens_outstanding=data_tokens_outstanding(tenant_id=tenant.pk),
        resident_bytes=cache_resident_bytes(tenant_id=tenant.pk),
    )


def data_tokens_outstanding(*, tenant_id: uuid.UUID, now=None) -> int:
    """Tokens of the tenant neither expired nor revoked (those the platform holds itself not counted)."""
    now = now or timezone.now()
    live = DataToken.objects.filter(tenant_id=tenant_id, revoked_at__isnull=True, expires_at__gt=now)
    return live.filter(platform_reader=False).count()


def caches_on_node(*, node_id: uuid.UUID) -> list[dict]:
    """What the control plane believes a node hosts (for its register response): id, epoch, state, capacity."""
    caches = Cache.objects.filter(node_id=node_id, state__in=RESERVING_STATES)
    return [
        {"cache_id": str(c.id), "epoch": c.epoch, "state": c.state, "capacity": c.capacity()}
        for c in caches.order_by("id")
    ]


def cache_ids_stored_on_node(*, node_id: uuid.UUID) -> list[str]:
    """The caches whose blocks a node may keep (for its register response): those placed on it that still hold a
    reservation there, and those an active migration is copying to it. A (re-)registering node deletes the SSD
    directories of every other cache (detached, failed, moved away while it was down). Sorted ids."""
    placed = Cache.objects.filter(node_id=node_id, state__in=RESERVING_STATES).values_list("id", flat=True)
    incoming = Migration.objects.filter(target_id=node_id, state__in=ACTIVE_MIGRATION_STATES).values_list(
        "cache_id", flat=True
    )
    return sorted({str(cache_id) for cache_id in [*placed, *incoming]})


MAX_REVOKED_LISTED = 100_000  # per node answer; bounded anyway by the outstanding-token quotas of its tenants


def data_tokens_cut_off(*, now=None) -> Q:
    """Unexpired tokens that must no longer open anything although nobody revoked them one by one: their tenant is
    not active (suspended, being erased, erased) or the API key that minted them is revoked or expired. The cascade
    (caches.token_cascade) marks them revoked; until it has, every register and heartbeat answer lists them anyway."""
    now = now or timezone.now()
    return (
        ~Q(tenant__status=Tenant.Status.ACTIVE) | Q(api_key__revoked_at__isnull=False) | Q(api_key__expires_at__lte=now)
    )


def data_tokens_revoked_on_node(*, node_id: uuid.UUID, now=None) -> list[dict]:
    """Revoked, not yet expired tokens of the caches placed on a node — revoked one by one, or cut off with their
    tenant or key (data_tokens_cut_off) — [{"jti", "exp"}] (exp in unix seconds), answered with every register and
    heartbeat so a node that missed a push, or restarted, refuses them too."""
    now = now or timezone.now()
    rows = (
        DataToken.objects.filter(
            Q(revoked_at__isnull=False) | data_tokens_cut_off(now=now), cache__node_id=node_id, expires_at__gt=now
        )
        .order_by("expires_at")
        .values_list("jti", "expires_at")[:MAX_REVOKED_LISTED]
    )
    return [{"jti": str(jti), "exp": int(expires_at.timestamp())} for jti, expires_at in rows]


# ---- console aggregations (read-only) -------------------------------------------------------------------------------


def cache_state_counts() -> dict[str, int]:
    """{state: number of caches} for every CacheState, zero included, in the enum's order (all tenants)."""
    counts = dict(Cache.objects.order_by().values("state").annotate(n=Count("id")).values_list("state", "n"))
    return {state: counts.get(state, 0) for state in CacheState.values}


def hosted_cache_counts(*, node_ids) -> dict[uuid.UUID, int]:
    """{node id: caches holding a reservation on it (pending, provisioning, ready, detaching)}; absent means 0."""
    rows = (
        Cache.objects.filter(node_id__in=list(node_ids), state__in=RESERVING_STATES)
        .order_by()
        .values("node_id")
        .annotate(n=Count("id"))
        .values_list("node_id", "n")
    )
    return dict(rows)


@dataclass(frozen=True, slots=True)
class HostedCache:
    """A cache placed on a node, as staff see it: never its keys."""

    id: uuid.UUID
    name: str
    state: str
    tenant_id: uuid.UUID
    tenant_name: str
    capacity_bytes: dict[str, int]
    resident_bytes: dict[str, int]  # the node's latest snapshot; 0 where it has not reported the cache


def caches_hosted_on(*, node: Node) -> list[HostedCache]:
    """The caches holding a reservation on `node` (tenant name, state, capacity) with the resident bytes the node
    last reported for each, by tenant name then cache name."""
    reported = (node.resident_snapshot or {}).get("caches") or {}
    caches = (
        Cache.objects.filter(node_id=node.pk, state__in=RESERVING_STATES)
        .select_related("tenant")
        .only("id", "name", "state", "tenant__name", *(f"{tier}_capacity_bytes" for tier in TIERS))
        .order_by("tenant__name", "name", "id")
    )
    return [
        HostedCache(
            id=c.id,
            name=c.name,
            state=c.state,
            tenant_id=c.tenant_id,
            tenant_name=c.tenant.name,
            capacity_bytes=c.capacity(),
            resident_bytes={tier: int((reported.get(str(c.id)) or {}).get(tier, 0) or 0) for tier in TIERS},
        )
        for c in caches
    ]


def migrations_of_node(*, node_id: uuid.UUID, limit: int = 50) -> dict[str, list[Migration]]:
    """{"incoming": [...], "outgoing": [...]}: the node's latest migrations each way (cache and the other node
    loaded), active ones first, then newest first."""
    base = Migration.objects.select_related("cache__tenant", "source", "target").order_by(
        Case(When(state__in=ACTIVE_MIGRATION_STATES, then=0), default=1), "-created_at", "id"
    )
    return {
        "incoming": list(base.filter(target_id=node_id)[:limit]),
        "outgoing": list(base.filter(source_id=node_id)[:limit]),
    }
