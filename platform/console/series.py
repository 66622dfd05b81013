"""The console's time-series charts, for the fleet (overview), a tenant and a node: resident bytes per tier and the
hit rate per hour over the last 24 hours (fleet.samples, from the nodes' heartbeats), and GB-hours per tier per UTC
day over 30 days (the billing ledger for the fleet and a tenant; for a node, estimated from its hourly samples,
since the ledger is kept per cache, not per node).

Data from the rooms' selectors in, chart markup out (console.charts draws); no business rule lives here.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.utils import timezone

from billing import selectors as billing_selectors
from console.charts import TIERS, Bar, LinePoint, daily_bars, line_chart, stacked_bar_chart
from fleet.samples import SeriesPoint, resident_series

HOURS = 24
DAYS = 30
GB = Decimal(10**9)
HOUR = timedelta(hours=1)


def _hour_range(now: datetime) -> tuple[datetime, datetime]:
    """[start, end): the last HOURS whole UTC hours, the current one included."""
    end = now.astimezone(UTC).replace(minute=0, second=0, microsecond=0) + HOUR
    return end - HOURS * HOUR, end


def _day_range(now: datetime) -> tuple[datetime, datetime]:
    today = now.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return today - timedelta(days=DAYS - 1), today + timedelta(days=1)


BYTE_UNITS = (("B", 1), ("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("TiB", 2**40))


def byte_unit(largest_bytes: int) -> tuple[str, Decimal]:
    """(name, bytes) of the largest binary unit that `largest_bytes` reaches (B below 1 KiB): an axis of a few MiB
    reads 0, 1, 2 MiB, not 0.0005 GiB steps."""
    name, size = BYTE_UNITS[0]
    for unit_name, unit_size in BYTE_UNITS:
        if largest_bytes >= unit_size:
            name, size = unit_name, unit_size
    return name, Decimal(size)


def _resident_unit(points: list[SeriesPoint]) -> tuple[str, Decimal]:
    """The unit of the resident chart: picked by its tallest bar (the tiers stacked)."""
    return byte_unit(max((sum(p.resident_bytes[tier] for tier in TIERS) for p in points), default=0))


def _resident_bars(points: list[SeriesPoint], unit: Decimal) -> list[Bar]:
    return [
        Bar(
            label=p.start.strftime("%Y-%m-%d %H:00"),
            tick=p.start.strftime("%H:00"),
            values={tier: Decimal(p.resident_bytes[tier]) / unit for tier in TIERS},
        )
        for p in points
    ]


def _hit_points(points: list[SeriesPoint]) -> list[LinePoint]:
    return [
        LinePoint(
            label=p.start.strftime("%Y-%m-%d %H:00"),
            tick=p.start.strftime("%H:00"),
            value=None if p.hit_rate is None else p.hit_rate * 100,
        )
        for p in points
    ]


def _ledger_bars(tenant_id: uuid.UUID | None, now: datetime) -> list[Bar]:
    start, end = _day_range(now)
    series = billing_selectors.usage_series(tenant_id=tenant_id, start=start, end=end, granularity="day")
    points = ((bucket.period_start.astimezone(UTC).date(), bucket.gb_hours) for bucket in series)
    return daily_bars(points, first_day=start.date(), days=DAYS)


def _sampled_gb_hour_bars(node_id: uuid.UUID, now: datetime) -> list[Bar]:
    """GB-hours per day estimated from the node's samples: each hour's latest resident bytes held for the hour."""
    start, end = _day_range(now)
    hourly = resident_series(start=start, end=end, bucket=HOUR, node_id=node_id)
    points = ((p.start.date(), {t: Decimal(p.resident_bytes[t]) / GB for t in TIERS}) for p in hourly)
    return daily_bars(points, first_day=start.date(), days=DAYS)


def charts_context(
    *,
    node_id: uuid.UUID | None = None,
    tenant_id: uuid.UUID | None = None,
    cache_ids: Iterable[uuid.UUID] | None = None,
) -> dict:
    """The three charts (markup, "" when empty) and their bars/points for the tables beside them: the fleet when
    neither is given, one node (`node_id`), or one tenant (`tenant_id` with its `cache_ids`)."""
    now = timezone.now()
    start, end = _hour_range(now)
    hourly = resident_series(start=start, end=end, bucket=HOUR, node_id=node_id, cache_ids=cache_ids)
    unit_name, unit = _resident_unit(hourly)
    resident, hits = _resident_bars(hourly, unit), _hit_points(hourly)
    days = _sampled_gb_hour_bars(node_id, now) if node_id is not None else _ledger_bars(tenant_id, now)
    day_start, day_end = _day_range(now)
    return {
        "resident_chart": stacked_bar_chart(resident, title=f"Resident {unit_name} per tier per hour", unit=unit_name),
        "resident_bars": resident,
        "resident_unit": unit_name,
        "hit_chart": line_chart(hits, title="Hit rate per hour", unit="%", top=Decimal(100)),
        "hit_points": hits,
        "gb_hours_chart": stacked_bar_chart(days, title="GB-hours per tier per day", unit="GB-hours"),
        "gb_hours_bars": days,
        "gb_hours_estimated": node_id is not None,
        "hours_start": start,
        "hours_end": end,
        "days_start": day_start.date(),
        "days_end": (day_end - timedelta(days=1)).date(),
    }
