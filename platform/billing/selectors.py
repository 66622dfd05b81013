"""Reads of the billing room. Tenant scoping happens here: given a tenant, a selector never returns another's rows.
The privacy room's portability export reads `usage_series` and `invoices_for_tenant`."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from django.db.models import F, QuerySet, Sum
from django.db.models.functions import TruncDay, TruncHour, TruncMonth

from billing import money
from billing.models import TIERS, Invoice, LedgerHour, Rate
from core.errors import NotFoundError
from core.ids import as_uuid

GRANULARITIES = {"hour": TruncHour, "day": TruncDay, "month": TruncMonth}


@dataclass(frozen=True, slots=True)
class UsageBucket:
    """A tenant's metered usage in one period: byte-seconds and GB-hours (exact Decimal) per tier, bytes written,
    tokens served."""

    period_start: datetime
    byte_seconds: dict[str, int]
    bytes_written: int
    tokens_served: int

    @property
    def gb_hours(self) -> dict[str, Decimal]:
        return {tier: money.gb_hours(self.byte_seconds[tier]) for tier in TIERS}

    def as_dict(self) -> dict:
        """JSON-ready: integers as integers, GB-hours as decimal strings."""
        return {
            "period_start": self.period_start.isoformat(),
            **{f"{tier}_byte_seconds": self.byte_seconds[tier] for tier in TIERS},
            **{f"{tier}_gb_hours": money.decimal_text(value) for tier, value in self.gb_hours.items()},
            "bytes_written": self.bytes_written,
            "tokens_served": self.tokens_served,
        }


def usage_series(*, tenant_id: uuid.UUID | None, start: datetime, end: datetime, granularity: str) -> list[UsageBucket]:
    """The tenant's ledger hours (every tenant's: the fleet's, for tenant_id None) in [start, end) summed per hour,
    UTC day or UTC month (periods without usage are left out), oldest first. Reads the ledger as the last rollup
    left it."""
    trunc = GRANULARITIES[granularity]
    hours = LedgerHour.objects.filter(hour__gte=start, hour__lt=end)
    if tenant_id is not None:
        hours = hours.filter(tenant_id=tenant_id)
    rows = (
        hours.annotate(period=trunc("hour"))
        .values("period")
        .annotate(
            **{tier: Sum(f"{tier}_byte_seconds") for tier in TIERS},
            written=Sum("bytes_written"),
            served=Sum("tokens_served"),
        )
        .order_by("period")
    )
    return [
        UsageBucket(
            period_start=row["period"],
            byte_seconds={tier: int(row[tier]) for tier in TIERS},
            bytes_written=int(row["written"]),
            tokens_served=int(row["served"]),
        )
        for row in rows
    ]


def _byte_seconds_by_tenant(hours: QuerySet[LedgerHour]) -> QuerySet:
    """Rows {tenant_id, tenant__name, total}: the byte-seconds of every tier (device, dram, ssd, network) of `hours`
    per tenant, unordered."""
    total = Sum(F("device_byte_seconds") + F("dram_byte_seconds") + F("ssd_byte_seconds") + F("network_byte_seconds"))
    return hours.values("tenant_id", "tenant__name").annotate(total=total).order_by()


def gb_hours_by_tenant(*, tenant_ids, start: datetime, end: datetime) -> dict[uuid.UUID, Decimal]:
    """{tenant id: GB-hours of every tier together in the ledger hours [start, end)} for the given tenants (one
    query; exact Decimal); a tenant without ledger hours there is absent."""
    hours = LedgerHour.objects.filter(tenant_id__in=list(tenant_ids), hour__gte=start, hour__lt=end)
    return {row["tenant_id"]: money.gb_hours(int(row["total"] or 0)) for row in _byte_seconds_by_tenant(hours)}


def invoices_for_tenant(*, tenant_id: uuid.UUID | None) -> QuerySet[Invoice]:
    """The tenant's invoices, newest month first, lines prefetched (tenant_id None: every tenant's, for staff)."""
    invoices = Invoice.objects.order_by("-month", "tenant_id").prefetch_related("lines")
    return invoices if tenant_id is None else invoices.filter(tenant_id=tenant_id)


def invoice_get(*, invoice_id, tenant_id: uuid.UUID | None) -> Invoice:
    """One invoice within the tenant (None: any, for staff); another tenant's is a 404 like a missing one."""
    wanted = as_uuid(invoice_id)
    invoice = invoices_for_tenant(tenant_id=tenant_id).filter(pk=wanted).first() if wanted else None
    if invoice is None:
        raise NotFoundError("No such invoice.")
    return invoice


def rate_list(*, meter: str | None = None) -> QuerySet[Rate]:
    rates = Rate.objects.order_by("meter", "effective_from")
    return rates if meter is None else rates.filter(meter=meter)


@dataclass(frozen=True, slots=True)
class TenantGbHours:
    """A tenant's ledgered byte-seconds over the three tiers since a point in time, and their GB-hours."""

    tenant_id: uuid.UUID
    tenant_name: str
    byte_seconds: int

    @property
    def gb_hours(self) -> Decimal:
        return money.gb_hours(self.byte_seconds)


def top_tenants_by_gb_hours(*, since: datetime, limit: int = 10) -> list[TenantGbHours]:
    """The `limit` tenants with the most byte-seconds (every tier) in ledger hours at or after `since`, most
    first (ties by tenant name); tenants with no such hours are left out. Reads the ledger as the last rollup
    left it."""
    rows = (
        _byte_seconds_by_tenant(LedgerHour.objects.filter(hour__gte=since))
        .filter(total__gt=0)
        .order_by("-total", "tenant__name", "tenant_id")[:limit]
    )
    return [TenantGbHours(row["tenant_id"], row["tenant__name"], int(row["total"])) for row in rows]
