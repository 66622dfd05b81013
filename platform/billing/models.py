"""Billing rows: node usage reports and their samples, the hourly ledger, rates and invoices.

Invariants held by billing.services (the only writer):
- a report is stored at most once per (node, boot_id, sequence) (the idempotency id): a duplicate changes nothing;
- a sample exists only for a cache placed on the reporting node when the report arrived, and only with a
  `sampled_at` inside the grace window (KCAAS_USAGE_GRACE_SECONDS) at arrival; `sampled_at` has whole seconds;
- `LedgerHour` rows are a pure function of the samples (billing.ledger): a rollup replaces the rows of the hours it
  covers, so running it again, or after reordered or duplicate reports, yields the same rows;
- a finalised invoice never changes; a tenant has at most one invoice per calendar month (UTC).
"""

import uuid

from django.db import models
from django.db.models import Q

TIERS: tuple[str, ...] = ("device", "dram", "ssd", "network")  # network: the fleet's store's objects of the cache
METERS: tuple[str, ...] = (
    "device_gb_hour",
    "dram_gb_hour",
    "ssd_gb_hour",
    "network_gb_hour",
    "write_gb",
    "read_million_tokens",
)

# Amounts below a cent are kept to this many decimal places (far below any currency's smallest unit).
AMOUNT_PLACES = 30
AMOUNT_DIGITS = 60


class UsageReport(models.Model):
    """One accepted node report: the idempotency record of (node, boot_id, sequence)."""

    id = models.BigAutoField(primary_key=True)
    node = models.ForeignKey("fleet.Node", on_delete=models.PROTECT, related_name="usage_reports")
    boot_id = models.UUIDField()
    sequence = models.BigIntegerField()
    sampled_at = models.DateTimeField()
    received_at = models.DateTimeField()
    accepted = models.PositiveIntegerField(default=0)
    refused = models.PositiveIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["node", "boot_id", "sequence"], name="billing_report_idempotency"),
        ]
        indexes = [models.Index(fields=["sampled_at"], name="billing_report_sampled")]


class UsageSample(models.Model):
    """One cache's absolute snapshot in one report: resident bytes per tier now, counters since the agent's boot."""

    id = models.BigAutoField(primary_key=True)
    cache = models.ForeignKey("caches.Cache", on_delete=models.PROTECT, related_name="usage_samples")
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="usage_samples")
    node = models.ForeignKey("fleet.Node", on_delete=models.PROTECT, related_name="usage_samples")
    boot_id = models.UUIDField()
    sequence = models.BigIntegerField()
    sampled_at = models.DateTimeField()
    device_bytes = models.BigIntegerField()
    dram_bytes = models.BigIntegerField()
    ssd_bytes = models.BigIntegerField()
    network_bytes = models.BigIntegerField(default=0)  # 0 in reports from agents without a network tier
    bytes_written_total = models.BigIntegerField()
    tokens_served_total = models.BigIntegerField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["node", "boot_id", "sequence", "cache"], name="billing_sample_once"),
            models.CheckConstraint(
                condition=Q(device_bytes__gte=0)
                & Q(dram_bytes__gte=0)
                & Q(ssd_bytes__gte=0)
                & Q(network_bytes__gte=0)
                & Q(bytes_written_total__gte=0)
                & Q(tokens_served_total__gte=0),
                name="billing_sample_nonneg",
            ),
        ]
        indexes = [
            models.Index(fields=["cache", "sampled_at"], name="billing_sample_cache_time"),
            models.Index(fields=["sampled_at"], name="billing_sample_time"),
        ]


class LedgerHour(models.Model):
    """What one cache used in one UTC hour: integer byte-seconds per tier, bytes written, tokens served."""

    id = models.BigAutoField(primary_key=True)
    cache = models.ForeignKey("caches.Cache", on_delete=models.PROTECT, related_name="ledger_hours")
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="ledger_hours")
    hour = models.DateTimeField()  # the hour's start, UTC
    device_byte_seconds = models.BigIntegerField(default=0)
    dram_byte_seconds = models.BigIntegerField(default=0)
    ssd_byte_seconds = models.BigIntegerField(default=0)
    network_byte_seconds = models.BigIntegerField(default=0)
    bytes_written = models.BigIntegerField(default=0)
    tokens_served = models.BigIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["cache", "hour"], name="billing_ledger_cache_hour")]
        indexes = [models.Index(fields=["tenant", "hour"], name="billing_ledger_tenant_hour")]


class Rate(models.Model):
    """The unit price of one meter from `effective_from` (an hour boundary) until the next rate of that meter."""

    id = models.BigAutoField(primary_key=True)
    meter = models.CharField(max_length=32, choices=[(m, m) for m in METERS])
    unit_price = models.DecimalField(max_digits=24, decimal_places=10)
    effective_from = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["meter", "effective_from"]
        constraints = [
            models.UniqueConstraint(fields=["meter", "effective_from"], name="billing_rate_meter_from"),
            models.CheckConstraint(condition=Q(unit_price__gte=0), name="billing_rate_nonneg"),
            models.CheckConstraint(condition=Q(meter__in=METERS), name="billing_rate_meter_valid"),
        ]


class InvoiceStatus(models.TextChoices):
    DRAFT = "draft"  # recomputed on every generation until finalised
    FINAL = "final"  # frozen


class Invoice(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.PROTECT, related_name="invoices")
    month = models.DateField()  # the first day of the calendar month (UTC)
    status = models.CharField(max_length=8, choices=InvoiceStatus.choices, default=InvoiceStatus.DRAFT)
    currency = models.CharField(max_length=3, default="USD")
    subtotal = models.DecimalField(max_digits=AMOUNT_DIGITS, decimal_places=AMOUNT_PLACES, default=0)
    total = models.DecimalField(max_digits=20, decimal_places=2, default=0)  # subtotal rounded once, half-even
    generated_at = models.DateTimeField()
    finalised_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-month", "tenant_id"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "month"], name="billing_invoice_tenant_month"),
            models.CheckConstraint(condition=Q(status__in=InvoiceStatus.values), name="billing_invoice_status"),
        ]


class InvoiceLine(models.Model):
    """One cache's use of one meter at one unit price. `usage` is in base units (byte-seconds, bytes, tokens);
    `quantity` in the meter's unit; `amount` = quantity x unit_price, unrounded (AMOUNT_PLACES places)."""

    id = models.BigAutoField(primary_key=True)
    invoice = models.ForeignKey(Invoice, on_delete=models.CASCADE, related_name="lines")
    cache = models.ForeignKey("caches.Cache", on_delete=models.PROTECT, related_name="+")
    meter = models.CharField(max_length=32, choices=[(m, m) for m in METERS])
    usage = models.BigIntegerField()
    quantity = models.DecimalField(max_digits=AMOUNT_DIGITS, decimal_places=AMOUNT_PLACES)
    unit_price = models.DecimalField(max_digits=24, decimal_places=10)
    rate_effective_from = models.DateTimeField()
    amount = models.DecimalField(max_digits=AMOUNT_DIGITS, decimal_places=AMOUNT_PLACES)

    class Meta:
        ordering = ["cache_id", "meter", "rate_effective_from"]
