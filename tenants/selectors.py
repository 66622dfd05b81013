"""Reads of the tenants app. Tenant scoping happens here: a selector given a tenant never returns another's rows."""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings
from django.db.models import Count, Q, QuerySet
from django.utils import timezone

from core.errors import NotFoundError
from core.ids import as_uuid
from tenants.models import QUOTA_FIELDS, ApiKey, Quota, Tenant


@dataclass(frozen=True, slots=True)
class QuotaLimits:
    """A tenant's effective limits: its overrides merged over settings.KCAAS_QUOTA_DEFAULTS."""

    max_caches: int
    max_device_bytes: int
    max_dram_bytes: int
    max_ssd_bytes: int
    max_network_bytes: int
    max_requests_per_second: int
    max_data_tokens_outstanding: int
    max_api_keys: int

    def capacity_bytes(self) -> dict[str, int]:
        """Per-tier byte limits keyed like cache capacities (``device``/``dram``/``ssd``/``network``)."""
        return {
            "device": self.max_device_bytes,
            "dram": self.max_dram_bytes,
            "ssd": self.max_ssd_bytes,
            "network": self.max_network_bytes,
        }


def _loaded_quota(tenant: Tenant) -> Quota | None:
    """The tenant's Quota row, using a select_related cache when present; None when the tenant has no row."""
    try:
        return tenant.quota
    except Quota.DoesNotExist:
        return None


def quota_limits(*, tenant: Tenant) -> QuotaLimits:
    defaults = settings.KCAAS_QUOTA_DEFAULTS
    quota = _loaded_quota(tenant)
    values = {}
    for field in QUOTA_FIELDS:
        override = getattr(quota, field) if quota is not None else None
        values[field] = int(override if override is not None else defaults[field])
    return QuotaLimits(**values)


def quota_overrides(*, tenant: Tenant) -> dict[str, int | None]:
    quota = _loaded_quota(tenant)
    return {field: (getattr(quota, field) if quota is not None else None) for field in QUOTA_FIELDS}


def tenant_list() -> QuerySet[Tenant]:
    return Tenant.objects.select_related("quota").order_by("created_at", "id")


def tenant_search(*, query: str = "") -> QuerySet[Tenant]:
    """Tenants whose name contains ``query`` (case-insensitive) or whose id it spells, oldest first; every tenant for
    a blank query."""
    query = (query or "").strip()
    tenants = tenant_list()
    if not query:
        return tenants
    wanted = as_uuid(query)
    matches = Q(name__icontains=query) | (Q(pk=wanted) if wanted else Q(pk__in=[]))
    return tenants.filter(matches)


def tenant_by_name_or_id(*, text: str) -> Tenant | None:
    """The tenant whose id (a UUID in any spelling) or exact name is `text`; None when there is none."""
    text = (text or "").strip()
    wanted = as_uuid(text)
    tenant = Tenant.objects.filter(pk=wanted).first() if wanted else None
    return tenant or (Tenant.objects.filter(name=text).first() if text else None)


def _usable(now) -> Q:
    return Q(revoked_at__isnull=True) & (Q(expires_at__isnull=True) | Q(expires_at__gt=now))


def active_key_counts(*, tenant_ids, now=None) -> dict:
    """{tenant id: number of its keys neither revoked nor expired at ``now``} for the given tenants (one query);
    a tenant without active keys is absent."""
    now = now or timezone.now()
    rows = (
        ApiKey.objects.filter(_usable(now), tenant_id__in=list(tenant_ids))
        .order_by()
        .values("tenant_id")
        .annotate(active=Count("id"))
    )
    return {row["tenant_id"]: row["active"] for row in rows}


def api_keys_usable(*, tenant_id, now=None, excluding=None) -> QuerySet[ApiKey]:
    """The tenant's keys neither revoked nor expired at ``now`` (what max_api_keys counts), without ``excluding``."""
    keys = ApiKey.objects.filter(_usable(now or timezone.now()), tenant_id=tenant_id)
    return keys.exclude(pk=excluding.pk) if excluding is not None else keys


def tenant_get(*, tenant_id) -> Tenant:
    wanted = as_uuid(tenant_id)
    tenant = Tenant.objects.select_related("quota").filter(pk=wanted).first() if wanted else None
    if tenant is None:
        raise NotFoundError("No such tenant.")
    return tenant


def api_key_list(*, tenant: Tenant) -> QuerySet[ApiKey]:
    return ApiKey.objects.filter(tenant=tenant).order_by("-created_at", "id")


def api_key_get(*, key_id, tenant: Tenant | None) -> ApiKey:
    """The key with that id, within ``tenant`` (None: any tenant, for staff). Another tenant's key is a 404."""
    wanted = as_uuid(key_id)
    queryset = ApiKey.objects.select_related("tenant")
    if tenant is not None:
        queryset = queryset.filter(tenant=tenant)
    api_key = queryset.filter(pk=wanted).first() if wanted else None
    if api_key is None:
        raise NotFoundError("No such API key.")
    return api_key


def api_key_for_authentication(*, public_id: str) -> ApiKey | None:
    """The key with that public id, its tenant and quota in one query (the per-request authentication read)."""
    return ApiKey.objects.select_related("tenant", "tenant__quota").filter(public_id=public_id).first()
