"""Writes of the billing room: node usage reports, the ledger rollup and sample pruning, rates.
(Invoices: billing.invoices.)

Time rules (settings):
- KCAAS_USAGE_GRACE_SECONDS: a report sampled longer ago than this when it arrives is ignored (answered
  `late: true`, nothing stored): the agent drops it. Inside the window it counts, whatever its order.
- KCAAS_USAGE_MAX_GAP_SECONDS: how long one sample's bytes may hold (billing.ledger).
- The ledger's hours before `frozen_before(now)` = floor_hour(now - grace - max_gap) can no longer change: every
  sample that could still be accepted lies after now - grace, and moves usage at most max_gap earlier. The rollup
  recomputes the hours from there; pruning keeps every sample those hours need.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from audit.actions import AuditAction
from audit.services import audit_record
from billing import ledger, money
from billing.errors import InvalidRate, InvalidUsageReport, RateExists
from billing.models import METERS, LedgerHour, Rate, UsageReport, UsageSample
from caches.models import Cache

logger = logging.getLogger("kcaas.billing")
REFUSED_NOT_PLACED = "not_placed_on_node"
_ROLLUP_LOCK = 0x6B63_6273  # pg advisory lock key of the rollup ("kcbs"): one rollup at a time (PostgreSQL)


# ---- node usage reports ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReportOutcome:
    duplicate: bool = False
    late: bool = False
    accepted: int = 0
    refused: list[dict] = field(default_factory=list)  # [{"cache_id", "reason"}]


def _whole_seconds(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(microsecond=0)


def _check_not_future(sampled_at: datetime, now: datetime) -> None:
    skew = timedelta(seconds=settings.KCAAS_USAGE_MAX_CLOCK_SKEW_SECONDS)
    if sampled_at > now + skew:
        raise InvalidUsageReport(
            "sampled_at is ahead of the control plane's clock by more than the allowed skew.",
            details={"sampled_at": sampled_at.isoformat(), "max_skew_seconds": int(skew.total_seconds())},
        )


def _placed(node_id: uuid.UUID, cache_ids: list[uuid.UUID]) -> dict[uuid.UUID, uuid.UUID]:
    """cache id -> tenant id of the given caches placed on the node (any state: a detached cache's last report
    still closes its usage)."""
    rows = Cache.objects.filter(pk__in=cache_ids, node_id=node_id).values_list("id", "tenant_id")
    return dict(rows)


def _samples(report: UsageReport, entries: list[dict], placed: dict) -> list[UsageSample]:
    return [
        UsageSample(
            cache_id=entry["cache_id"],
            tenant_id=placed[entry["cache_id"]],
            node_id=report.node_id,
            boot_id=report.boot_id,
            sequence=report.sequence,
            sampled_at=report.sampled_at,
            device_bytes=entry["device_bytes"],
            dram_bytes=entry["dram_bytes"],
            ssd_bytes=entry["ssd_bytes"],
            network_bytes=entry.get("network_bytes", 0),
            bytes_written_total=entry["bytes_written_total"],
            tokens_served_total=entry["tokens_served_total"],
        )
        for entry in entries
        if entry["cache_id"] in placed
    ]


@transaction.atomic
def usage_report_record(
    *,
    node_id: uuid.UUID,
    boot_id: uuid.UUID,
    sequence: int,
    sampled_at: datetime,
    entries: list[dict],
    now: datetime | None = None,
) -> ReportOutcome:
    """Store one node report's samples, once per (node, boot_id, sequence).

    `entries`: validated dicts (cache_id UUID, device/dram/ssd_bytes, optionally network_bytes (absent: 0),
    bytes_written_total, tokens_served_total, non-negative ints, each cache once). A duplicate changes nothing; a
    report sampled before now - grace is ignored (late); entries for caches not placed on the node are refused and
    audited (USAGE_REPORT_REFUSED, one event per report listing them), the others stored. InvalidUsageReport (400)
    for a time in the node's future.
    """
    now = now or timezone.now()
    sampled_at = _whole_seconds(sampled_at)
    _check_not_future(sampled_at, now)
    if UsageReport.objects.filter(node_id=node_id, boot_id=boot_id, sequence=sequence).exists():
        return ReportOutcome(duplicate=True)
    if sampled_at < now - timedelta(seconds=settings.KCAAS_USAGE_GRACE_SECONDS):
        logger.warning("node %s: late usage report %s/%s (%s) ignored", node_id, boot_id, sequence, sampled_at)
        return ReportOutcome(late=True)
    placed = _placed(node_id, [entry["cache_id"] for entry in entries])
    refused = [
        {"cache_id": str(e["cache_id"]), "reason": REFUSED_NOT_PLACED} for e in entries if e["cache_id"] not in placed
    ]
    report = UsageReport(
        node_id=node_id,
        boot_id=boot_id,
        sequence=sequence,
        sampled_at=sampled_at,
        received_at=now,
        accepted=len(entries) - len(refused),
        refused=len(refused),
    )
    try:
        with transaction.atomic():
            report.save(force_insert=True)
    except IntegrityError:  # a concurrent delivery of the same report won
        return ReportOutcome(duplicate=True)
    UsageSample.objects.bulk_create(_samples(report, entries, placed))
    if refused:
        _audit_refused(report, refused)
    return ReportOutcome(accepted=report.accepted, refused=refused)


def _audit_refused(report: UsageReport, refused: list[dict]) -> None:
    audit_record(
        action=AuditAction.USAGE_REPORT_REFUSED,
        target_type="node",
        target_id=report.node_id,
        new={
            "boot_id": report.boot_id,
            "sequence": report.sequence,
            "sampled_at": report.sampled_at,
            "refused_cache_ids": [entry["cache_id"] for entry in refused],
            "reason": REFUSED_NOT_PLACED,
        },
    )


# ---- the ledger -----------------------------------------------------------------------------------------------------


def _epoch(moment: datetime) -> int:
    return int(moment.timestamp())


def _moment(seconds: int) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


def frozen_before(now: datetime) -> datetime:
    """The first hour the ledger may still change in (see the module docstring)."""
    margin = settings.KCAAS_USAGE_GRACE_SECONDS + settings.KCAAS_USAGE_MAX_GAP_SECONDS
    return _moment(ledger.hour_floor(_epoch(now) - margin))


def _as_sample(row: UsageSample) -> ledger.Sample:
    return ledger.Sample(
        node_id=str(row.node_id),
        boot_id=str(row.boot_id),
        sequence=row.sequence,
        sampled_at=_epoch(row.sampled_at),
        device_bytes=row.device_bytes,
        dram_bytes=row.dram_bytes,
        ssd_bytes=row.ssd_bytes,
        network_bytes=row.network_bytes,
        bytes_written_total=row.bytes_written_total,
        tokens_served_total=row.tokens_served_total,
    )


def _cache_samples(cache_id, lower: datetime, end: datetime) -> list[ledger.Sample]:
    """The samples `ledger.integrate` needs: those in [lower, end) plus each of their boots' last one before."""
    window = list(UsageSample.objects.filter(cache_id=cache_id, sampled_at__gte=lower, sampled_at__lt=end))
    boots = {(row.node_id, row.boot_id) for row in window}
    before = UsageSample.objects.filter(cache_id=cache_id, sampled_at__lt=lower).order_by("-sequence")
    # one query per boot (a cache sees a boot per agent start): portable, where DISTINCT ON is PostgreSQL's
    baselines = [before.filter(node_id=node_id, boot_id=boot_id).first() for node_id, boot_id in boots]
    return [_as_sample(row) for row in [*window, *baselines] if row is not None]


def ledger_rollup(*, start: datetime, end: datetime) -> int:
    """Recompute the ledger hours in [start, end) (hour aligned) from the samples; returns the rows written.

    Replaces those hours' rows in one transaction, so it is idempotent and a rerun over the same samples writes
    the same rows. Rollups are serialised: on PostgreSQL by an advisory lock, on SQLite (the embedded default) by
    the write lock its immediate transactions take at BEGIN (settings.DATABASES)."""
    start_s, end_s = _epoch(start), _epoch(end)
    if start_s % ledger.HOUR or end_s % ledger.HOUR:
        raise ValueError("a rollup window starts and ends on whole hours")
    max_gap = settings.KCAAS_USAGE_MAX_GAP_SECONDS
    lower = _moment(ledger.window_lower(start_s, max_gap))
    with transaction.atomic():
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_xact_lock(%s)", [_ROLLUP_LOCK])
        LedgerHour.objects.filter(hour__gte=start, hour__lt=end).delete()
        caches = (
            UsageSample.objects.filter(sampled_at__gte=lower, sampled_at__lt=end)
            .values_list("cache_id", "tenant_id")
            .distinct()
        )
        rows = []
        for cache_id, tenant_id in caches:
            hours = ledger.integrate(_cache_samples(cache_id, lower, end), start=start_s, end=end_s, max_gap=max_gap)
            rows += [_ledger_row(cache_id, tenant_id, hour, usage) for hour, usage in hours.items()]
        LedgerHour.objects.bulk_create(rows, batch_size=1000)
    return len(rows)


def _ledger_row(cache_id, tenant_id, hour: int, usage: ledger.HourUsage) -> LedgerHour:
    return LedgerHour(
        cache_id=cache_id,
        tenant_id=tenant_id,
        hour=_moment(hour),
        device_byte_seconds=usage.byte_seconds["device"],
        dram_byte_seconds=usage.byte_seconds["dram"],
        ssd_byte_seconds=usage.byte_seconds["ssd"],
        network_byte_seconds=usage.byte_seconds["network"],
        bytes_written=usage.bytes_written,
        tokens_served=usage.tokens_served,
    )


def ledger_rollup_open_hours(*, now: datetime | None = None) -> int:
    """Beat: recompute every hour that may still change, up to the last hour a sample can reach."""
    now = now or timezone.now()
    reach = settings.KCAAS_USAGE_MAX_GAP_SECONDS + settings.KCAAS_USAGE_MAX_CLOCK_SKEW_SECONDS
    end = _moment(ledger.hour_floor(_epoch(now) + reach) + ledger.HOUR)
    return ledger_rollup(start=frozen_before(now), end=end)


def usage_samples_prune(*, now: datetime | None = None) -> int:
    """Forget samples and report records no open hour needs; returns the samples deleted.

    Kept: every sample sampled from frozen_before(now) - max_gap on (the open hours' window), and, per
    (cache, node, boot), the last one before that (a counter baseline). Report records go once a resend of them
    would be late anyway. Run after a rollup of the open hours (the `billing.rollup` task does both)."""
    now = now or timezone.now()
    cutoff = frozen_before(now) - timedelta(seconds=settings.KCAAS_USAGE_MAX_GAP_SECONDS)
    with connection.cursor() as cursor:
        cursor.execute(
            """DELETE FROM billing_usagesample AS s WHERE s.sampled_at < %s AND EXISTS (
                   SELECT 1 FROM billing_usagesample n WHERE n.cache_id = s.cache_id AND n.node_id = s.node_id
                   AND n.boot_id = s.boot_id AND n.sampled_at < %s AND n.sequence > s.sequence)""",
            [cutoff, cutoff],
        )
        deleted = cursor.rowcount
    late = now - timedelta(seconds=settings.KCAAS_USAGE_GRACE_SECONDS)
    UsageReport.objects.filter(sampled_at__lt=late).delete()
    return deleted


# ---- rates ----------------------------------------------------------------------------------------------------------


@transaction.atomic
def rate_create(*, meter: str, unit_price: Decimal, effective_from: datetime) -> Rate:
    """A new price for `meter` from `effective_from` (a whole UTC hour) until the meter's next rate. Rates are
    never edited: a later one supersedes. Audited (RATE_CREATED). 409 rate_exists for the same meter and time."""
    if meter not in METERS:
        raise InvalidRate(f"Unknown meter {meter!r}.", details={"meters": list(METERS)})
    if not isinstance(unit_price, Decimal) or not unit_price.is_finite() or unit_price < 0:
        raise InvalidRate("unit_price is a non-negative decimal.")
    effective_from = effective_from.astimezone(UTC)
    if effective_from.minute or effective_from.second or effective_from.microsecond:
        raise InvalidRate("effective_from must be a whole UTC hour.", details={"effective_from": str(effective_from)})
    rate = Rate(meter=meter, unit_price=unit_price, effective_from=effective_from)
    try:
        with transaction.atomic():
            rate.save(force_insert=True)
    except IntegrityError:
        raise RateExists(
            "A rate of this meter takes effect at that time already.",
            details={"meter": meter, "effective_from": effective_from.isoformat()},
        ) from None
    audit_record(
        action=AuditAction.RATE_CREATED,
        target_type="rate",
        target_id=rate.pk,
        new={"meter": meter, "unit_price": money.decimal_text(unit_price), "effective_from": effective_from},
    )
    return rate
