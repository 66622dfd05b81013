"""Invoices: one per tenant per calendar month (UTC), computed from the ledger and the rates.

- Lines: per (cache, meter, rate): the ledger's base units of the month's hours priced at the rate in effect at
  each hour's start (a rate change mid-month splits a cache's meter into two lines). Hours without a rate of a
  meter are not billed for it. Amounts are unrounded (billing.money); the total is their sum rounded once to the
  cent, half to even.
- Idempotent: (tenant, month) is unique; generating again recomputes a draft in place, and leaves a final invoice
  alone. An invoice becomes final on the first generation at or after the month's end + KCAAS_INVOICE_GRACE_DAYS
  (audited INVOICE_FINALISED); from then on it never changes.
- The grace must cover the usage grace (KCAAS_USAGE_GRACE_SECONDS + KCAAS_USAGE_MAX_GAP_SECONDS), so no accepted
  report can change a final invoice's hours.
"""

from __future__ import annotations

import uuid
from bisect import bisect_right
from collections import defaultdict
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from audit.actions import AuditAction
from audit.services import audit_record
from billing import money
from billing.models import Invoice, InvoiceLine, InvoiceStatus, LedgerHour, Rate


def month_start(moment: date | datetime) -> datetime:
    return datetime(moment.year, moment.month, 1, tzinfo=UTC)


def next_month(start: datetime) -> datetime:
    return datetime(start.year + start.month // 12, start.month % 12 + 1, 1, tzinfo=UTC)


def finalisable_at(month: date) -> datetime:
    """When the month's invoice becomes final: the month's end plus the grace days."""
    return next_month(month_start(month)) + timedelta(days=settings.KCAAS_INVOICE_GRACE_DAYS)


class _RateBook:
    """The rates of every meter, to find the one in effect at an hour."""

    def __init__(self, until: datetime):
        self._by_meter: dict[str, list[Rate]] = defaultdict(list)
        for rate in Rate.objects.filter(effective_from__lt=until).order_by("meter", "effective_from"):
            self._by_meter[rate.meter].append(rate)
        self._starts = {meter: [r.effective_from for r in rates] for meter, rates in self._by_meter.items()}

    def at(self, meter: str, moment: datetime) -> Rate | None:
        index = bisect_right(self._starts.get(meter, []), moment)
        return self._by_meter[meter][index - 1] if index else None


def _priced_usage(tenant_id, start: datetime, end: datetime) -> dict[tuple, int]:
    """(cache_id, meter, rate) -> base units of the tenant's hours in [start, end) priced at that rate."""
    rates = _RateBook(end)
    usage: dict[tuple, int] = defaultdict(int)
    hours = LedgerHour.objects.filter(tenant_id=tenant_id, hour__gte=start, hour__lt=end).order_by("hour")
    for row in hours:
        for meter, (source, _) in money.METER_SOURCES.items():
            units = getattr(row, source)
            rate = rates.at(meter, row.hour) if units else None
            if rate is not None:
                usage[(row.cache_id, meter, rate)] += units
    return usage


def _lines(invoice: Invoice, usage: dict[tuple, int]) -> list[InvoiceLine]:
    return [
        InvoiceLine(
            invoice=invoice,
            cache_id=cache_id,
            meter=meter,
            usage=units,
            quantity=money.quantity(meter, units),
            unit_price=rate.unit_price,
            rate_effective_from=rate.effective_from,
            amount=money.amount(meter, units, rate.unit_price),
        )
        for (cache_id, meter, rate), units in sorted(usage.items(), key=lambda item: _line_order(item[0]))
    ]


def _line_order(key: tuple) -> tuple:
    cache_id, meter, rate = key
    return (str(cache_id), meter, rate.effective_from)


def _lock_or_create(tenant_id, month: datetime, now: datetime) -> Invoice:
    found = Invoice.objects.select_for_update(no_key=True).filter(tenant_id=tenant_id, month=month.date()).first()
    if found is not None:
        return found
    try:
        with transaction.atomic():
            return Invoice.objects.create(
                tenant_id=tenant_id, month=month.date(), generated_at=now, currency=settings.KCAAS_BILLING_CURRENCY
            )
    except IntegrityError:  # a concurrent generation created it: wait for its lock
        return Invoice.objects.select_for_update(no_key=True).get(tenant_id=tenant_id, month=month.date())


@transaction.atomic
def invoice_generate(*, tenant_id: uuid.UUID, month: date | datetime, now: datetime | None = None) -> Invoice:
    """The tenant's invoice of the calendar month containing `month`, created or recomputed (draft), finalised
    when due. Idempotent; concurrent calls serialise on the invoice's row lock."""
    now = now or timezone.now()
    start = month_start(month)
    invoice = _lock_or_create(tenant_id, start, now)
    if invoice.status == InvoiceStatus.FINAL:
        return invoice
    InvoiceLine.objects.filter(invoice=invoice).delete()
    lines = InvoiceLine.objects.bulk_create(_lines(invoice, _priced_usage(tenant_id, start, next_month(start))))
    invoice.subtotal = sum((line.amount for line in lines), Decimal(0))
    invoice.total = money.round_total(invoice.subtotal)
    invoice.generated_at = now
    if now >= finalisable_at(start):
        _finalise(invoice, now)
    invoice.save()
    return invoice


def _finalise(invoice: Invoice, now: datetime) -> None:
    invoice.status, invoice.finalised_at = InvoiceStatus.FINAL, now
    audit_record(
        action=AuditAction.INVOICE_FINALISED,
        target_type="invoice",
        target_id=invoice.pk,
        tenant_id=invoice.tenant_id,
        old={"status": InvoiceStatus.DRAFT},
        new={
            "status": InvoiceStatus.FINAL,
            "month": invoice.month.strftime("%Y-%m"),
            "total": invoice.total,
            "currency": invoice.currency,
        },
    )


def invoices_generate_due(*, now: datetime | None = None) -> int:
    """Beat: generate (or refresh) the invoices of every tenant with usage in the current or previous month, and
    every draft still open (finalising those due). Returns how many were generated."""
    now = now or timezone.now()
    current = month_start(now)
    previous = month_start(current - timedelta(days=1))
    recent = LedgerHour.objects.filter(hour__gte=previous, hour__lt=next_month(current))
    with_usage = set(recent.values_list("tenant_id", "hour__year", "hour__month").distinct())
    drafts = set(
        Invoice.objects.filter(status=InvoiceStatus.DRAFT).values_list("tenant_id", "month__year", "month__month")
    )
    due = sorted(with_usage | drafts, key=lambda key: (key[1], key[2], str(key[0])))
    for tenant_id, year, month in due:
        invoice_generate(tenant_id=tenant_id, month=date(year, month, 1), now=now)
    return len(due)
